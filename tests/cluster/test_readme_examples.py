"""README's examples, run as written against what `make serve` serves: `tokenflow serve --config
configs/local.yaml` (the shipped default: SmolLM2's 4-bit file, a bfloat16 KV cache, the layers
compiled), each example twice, on a cold server and again with its prefixes cached.

The examples are read out of README.md: the curl under "Talk to it" (its JSON body posted, its
answer compared with the `"content"` its comment shows) and every Python block from there to
"Repetition stop" that asks the default model (not "Reasoning output"'s, for a Qwen3
checkpoint), in order and in one namespace (later blocks use the first one's `client`), the
client pointed at this server. What a block must print is what its comments say: a comment on a
`print(` line, or a comment line right after a `print(` line or an indented block (what the
loop above printed).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import free_port
from tests.cluster.serve_process import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]  # starts its own Ray cluster

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
READY = "serving the OpenAI API"


def _section(start: str, end: str) -> str:
    return README[README.index(start):README.index(end)]


def curl_example() -> tuple[dict, str]:
    """The first curl's JSON body and the content its comment shows."""
    block = re.search(r"```bash\n(curl .*?)```", _section("## Talk to it", "### Responses API"),
                      re.S)
    assert block, "README's first example is a curl"
    body = json.loads(re.search(r"-d '(.*?)'", block.group(1), re.S).group(1))
    comments = "\n".join(line for line in block.group(1).splitlines() if line.startswith("#"))
    return body, re.search(r'"content": "(.*?)"', comments).group(1)


def python_examples() -> list[tuple[str, list[str]]]:
    """Each Python block of the API's sections and what its comments say it prints."""
    text = _section("## Talk to it", "### Repetition stop")
    examples = []
    for code in re.findall(r"```python\n(.*?)```", text, re.S):
        if "smollm2-135m-instruct" not in code:
            continue
        expected, previous = [], ""
        for line in code.splitlines():
            comment = re.search(r"#\s*(.+)$", line)
            on_print = comment and "print(" in line.split("#")[0]
            after_output = line.startswith("#") and previous.startswith((" ", "\t", "print("))
            if on_print or after_output:
                expected.append(comment.group(1).strip())
            if line.strip():
                previous = line
        examples.append((code, expected))
    return examples


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    ray_tmp = tempfile.mkdtemp(prefix="tf-", dir="/tmp")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, PYTHONPATH=str(ROOT))
    port = free_port()
    process = ServeProcess(["--config", str(ROOT / "configs" / "local.yaml"), "--port",
                            str(port)], env)
    try:
        # Compiling the layers takes ~2 minutes with inductor's cache empty on 2 cores.
        process.wait_for(READY, timeout_s=600)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        subprocess.run(["rm", "-rf", ray_tmp], check=False)


def test_the_readme_examples_are_read_from_the_readme() -> None:
    body, content = curl_example()
    assert body["temperature"] == 0 and content == "The capital of France is Paris."
    examples = python_examples()
    assert len(examples) >= 4
    assert ["The capital of Japan is Tokyo."] in [e for _, e in examples]
    assert not any("qwen3" in code for code, _ in examples)


def test_every_readme_example_answers_as_printed_cold_and_warm(server: str) -> None:
    body, content = curl_example()
    examples = python_examples()
    for round_ in ("cold", "warm"):
        answer = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=300).json()
        assert answer["choices"][0]["message"]["content"] == content, round_
        namespace: dict = {"__name__": "readme"}
        for code, expected in examples:
            code = code.replace("http://127.0.0.1:8000", server)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
            for line in expected:
                assert line in printed.getvalue(), (round_, line, printed.getvalue(), code)
