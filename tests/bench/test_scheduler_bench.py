"""The scheduler benchmark's decision dump: one JSON line a step, naming every request's
admission, preemption, resumption and finish, so two schedulers' runs can be diffed. It writes
nothing unless asked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import scheduler_overhead  # noqa: E402

# Small enough to preempt: 8 requests of 48-64 prompt tokens in 24 blocks of 16.
TINY = ["--requests", "8", "--prompt-len", "48:64", "--output-len", "20:30", "--max-num-seqs",
        "8", "--num-blocks", "24", "--max-model-len", "128", "--quiet", "--no-gc-freeze"]


def test_dump_decisions_accounts_for_every_request(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    dump = tmp_path / "decisions.jsonl"
    scheduler_overhead.main([*TINY, "--dump-decisions", str(dump)])
    steps = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    new = [r for s in steps for r in s["new"]]
    finished = [r for s in steps for r in s["finished"]]
    assert sorted(new) == sorted(set(new)) and len(new) == 8  # each admitted once
    assert sorted(finished) == sorted(new)  # and finished once
    preempted = [r for s in steps for r in s["preempted"]]
    resumed = [r for s in steps for r in s["resumed"]]
    assert preempted, "the tiny cache must preempt"
    assert sorted(resumed) == sorted(preempted)  # every preempted request came back
    assert all(n > 0 for s in steps for n in s["tokens"].values())
    # The same trace gives the same decisions (the dump is for diffing runs).
    again = tmp_path / "again.jsonl"
    scheduler_overhead.main([*TINY, "--dump-decisions", str(again)])
    assert again.read_text() == dump.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.jsonl", "decisions.jsonl"]
