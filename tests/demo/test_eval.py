"""`tokenmill eval`: the shipped target reaches its documented accuracy through the engine,
engine settings that must not change greedy answers don't, and the CLI and server client work."""

from __future__ import annotations

import json
import shlex
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.demo import demo_model_path
from tokenmill.demo.catalog import EXAMPLES
from tokenmill.demo.eval import (
    ACCURACY_BARS,
    BAR_NUM_PER_TASK,
    EvalReport,
    evaluate,
    heldout,
    offline_replies,
    replies_to,
    score,
    server_replies,
)
from tokenmill.demo.tasks import CHECKABLE_TASKS
from tokenmill.entrypoints.cli import main


@pytest.fixture(scope="module")
def examples():
    return heldout(BAR_NUM_PER_TASK)


def _replies(llm: LLM, examples) -> list[str]:
    return replies_to(examples, offline_replies(llm))


@pytest.fixture(scope="module")
def baseline_replies(examples) -> list[str]:
    return _replies(LLM(model=str(demo_model_path("target")), dtype="float32"), examples)


@pytest.fixture(scope="module")
def baseline(examples, baseline_replies) -> EvalReport:
    return score(examples, baseline_replies)


def test_every_task_has_a_documented_bar() -> None:
    assert set(ACCURACY_BARS) == set(CHECKABLE_TASKS)


@pytest.mark.slow(reason="evaluates the demo target on the whole held-out set")
def test_target_reaches_the_documented_accuracy(baseline: EvalReport) -> None:
    assert baseline.below_bars(ACCURACY_BARS) == [], "\n" + baseline.table(ACCURACY_BARS)


@pytest.mark.slow(reason="the held-out set again, chunked and preempted")
def test_chunked_prefill_and_preemption_keep_every_greedy_reply(examples, baseline_replies):
    """A 64-token step budget splits every prompt into chunks, and a KV cache of 96 blocks
    (1536 tokens) holds about one long lookup at a time, so requests are preempted and
    recomputed: every reply must still be the baseline's, prompt by prompt."""
    llm = LLM(
        model=str(demo_model_path("target")),
        dtype="float32",
        max_num_batched_tokens=64,
        num_kv_blocks=96,
    )
    assert _replies(llm, examples) == baseline_replies
    assert llm.get_stats().scheduler.num_preemptions > 0


def test_eval_command_prints_a_table_per_task(capsys) -> None:
    assert main(["eval", "--tasks", "add,reverse", "--num-per-task", "2"]) == 0
    captured = capsys.readouterr()
    assert "4 held-out prompts" in captured.out
    assert captured.out.count("/2") == 2 and "overall" in captured.out
    assert "Processed prompts" in captured.err and "4/4" in captured.err  # a progress bar


def test_models_command_lists_the_builtin_models(capsys) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "tokenmill-demo-target" in out and "tokenmill-demo-draft" in out


def suggested_commands(out: str) -> str:
    """The block of commands `tokenmill models` prints, as a newcomer would paste it."""
    block = out.split("Try these", 1)[1].split("\n", 1)[1]
    return block.split("\n\nMeasure it", 1)[0]


def test_the_suggested_commands_give_the_prompts_when_pasted(capsys) -> None:
    """They printed `--prompt '...\\n...'`: pasted, the backslash-n stayed two characters."""
    assert main(["models"]) == 0
    block = suggested_commands(capsys.readouterr().out)
    words = shlex.split(block, comments=True)
    commands = " ".join(words).count("tokenmill generate --chat --prompt")
    assert commands == len(EXAMPLES)
    prompts = [words[i + 1] for i, word in enumerate(words) if word == "--prompt"]
    assert prompts == list(EXAMPLES)
    # And as bash runs them, with `tokenmill` standing in for a function that prints --prompt.
    script = 'tokenmill() { printf "%s\\0" "$4"; }\n' + block
    ran = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert ran.stdout.split("\0")[:-1] == list(EXAMPLES)


# The README's offline `llm.chat` example, whose reply it shows in a comment.
README_CHAT_EXAMPLE = ("Reverse this list: cat dog fox", "fox dog cat")


def test_every_example_of_tokenmill_models_gets_the_reply_it_shows() -> None:
    """`tokenmill models` and the README suggest these prompts: the demo target must answer
    each as shown, or a newcomer's first try fails."""
    readme_prompt, readme_reply = README_CHAT_EXAMPLE
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert f'"content": "{readme_prompt}"' in readme and f"# {readme_reply} " in readme
    checkable = {prompt: reply for prompt, reply in EXAMPLES.items() if reply is not None}
    checkable[readme_prompt] = readme_reply
    llm = LLM(model=str(demo_model_path("target")), dtype="float32")
    conversations = [[{"role": "user", "content": prompt}] for prompt in checkable]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=64))
    assert dict(zip(checkable, [o.outputs[0].text for o in outputs])) == checkable


API_KEY = "sk-eval-test"


class _FakeChatServer(BaseHTTPRequestHandler):
    """Answers /v1/chat/completions with the user's message reversed word by word, to
    requests that carry the API key."""

    def do_GET(self) -> None:
        if self._authorized():
            self._send({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        if not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == "fake-model" and body["temperature"] == 0.0
        words = body["messages"][-1]["content"].split(":", 1)[1].split()
        message = {"role": "assistant", "content": " ".join(reversed(words))}
        self._send({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {API_KEY}":
            return True
        error = {"error": {"message": "Incorrect API key provided.", "code": "invalid_api_key"}}
        data = json.dumps(error).encode()
        self.send_response(401)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return False

    def _send(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeChatServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_eval_of_a_keyed_server_reads_the_key_from_the_environment(
    fake_server: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """As `tokenmill serve` reads $TOKENMILL_API_KEY."""
    monkeypatch.setenv("TOKENMILL_API_KEY", API_KEY)
    argv = ["eval", "--url", fake_server, "--tasks", "reverse", "--num-per-task", "2"]
    assert main([*argv, "--disable-tqdm"]) == 0
    assert "2/2" in capsys.readouterr().out


def test_eval_without_the_key_says_what_the_server_said_and_what_to_do(
    fake_server: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    argv = ["eval", "--url", fake_server, "--tasks", "reverse", "--num-per-task", "2"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "/v1/models answered 401: Incorrect API key provided." in error
    assert "--api-key" in error and "TOKENMILL_API_KEY" in error
    assert main([*argv, "--api-key", "wrong"]) == 2
    assert "the key given (--api-key or $TOKENMILL_API_KEY) was refused" in capsys.readouterr().err


def test_server_eval_uses_the_chat_completions_api(fake_server: str, capsys) -> None:
    replies = server_replies(fake_server, api_key=API_KEY, progress=True)
    report = evaluate(heldout(5, ["reverse"]), replies)
    assert report.scores["reverse"].num_correct == 5
    assert "5/5" in capsys.readouterr().err  # a progress bar
