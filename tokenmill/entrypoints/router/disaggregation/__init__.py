"""Prefill/decode disaggregation in the router (`tokenmill router --prefill --decode`): each
generation request split into a prefill leg and a decode leg (`split_proxy.py`), the app in
front of the two kinds of instance (`app.py`)."""
