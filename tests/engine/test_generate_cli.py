"""`flashpd generate --requests FILE.jsonl`: concurrent requests, prefix hits when sequential."""

from __future__ import annotations

import json

import torch

from flashpd.cli import main


def _ids(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_requests_file_sequential_gets_prefix_hits(ckpt_dir, tmp_path, capsys):
    shared = _ids(300, 1)
    lines = [
        {"id": "a", "prompt_ids": shared, "max_tokens": 2},
        {"id": "b", "prompt_ids": shared + _ids(20, 2), "max_tokens": 2},
        {"id": "c", "prompt": "Hello there", "max_tokens": 3, "temperature": 0.7, "seed": 3},
    ]
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    assert main(["generate", "--checkpoint", ckpt_dir, "--requests", str(path), "--sequential"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [o["id"] for o in out] == ["a", "b", "c"]
    assert out[0]["cached_tokens"] == 0 and out[1]["cached_tokens"] == 128
    for o in out:
        assert {"output_ids", "text", "prompt_tokens", "ttft_ms", "finish_reason"} <= set(o)


def test_single_prompt_json(ckpt_dir, capsys):
    assert main(["generate", "--checkpoint", ckpt_dir, "--prompt-ids", "5,6,7", "--max-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == [5, 6, 7] and len(out["output_ids"]) <= 3


def test_stop_string_cuts_text_and_finishes(ckpt_dir, tmp_path, capsys):
    def generate(extra: dict) -> dict:
        line = {"id": "r", "prompt_ids": _ids(20, 50), "max_tokens": 12, "ignore_eos": True}
        path = tmp_path / "reqs.jsonl"
        path.write_text(json.dumps({**line, **extra}))
        assert main(["generate", "--checkpoint", ckpt_dir, "--requests", str(path)]) == 0
        return json.loads(capsys.readouterr().out)

    free = generate({})
    stop = free["text"][3:6]
    assert stop and free["finish_reason"] == "length"
    cut = generate({"stop": [stop]})
    assert cut["text"] == free["text"][: free["text"].index(stop)]
    assert cut["finish_reason"] == "stop"
    assert cut["output_ids"] == free["output_ids"][: len(cut["output_ids"])]
