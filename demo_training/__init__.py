"""Training the built-in demo models (`tokenmill/demo/weights`): the tokenizer, the target and
its draft (`python -m demo_training.train`), the speculative heads
(`python -m demo_training.train_heads`), and the draft-acceptance numbers of
docs/demo_models.md (`python -m demo_training.acceptance`). Not part of the installed package:
run from a checkout of the repository."""
