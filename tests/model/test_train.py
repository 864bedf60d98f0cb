"""`flashpd train`: the training forward equals the serving forward on the export; a few CPU steps
lower the loss; the exported checkpoint loads and generates through the engine."""

from __future__ import annotations

import json
import os

import pytest
import torch

from flashpd.model import train as tr
from flashpd.model.checkpoint import load_checkpoint


@pytest.fixture(scope="module")
def tiny():
    return tr.load_preset("tiny")  # (cfg, tokenizer path, hasher)


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(5, vocab, (n - 1,), generator=g).tolist()


def test_training_forward_equals_the_model_forward_on_the_export(tiny, tmp_path):
    cfg, tok, hasher = tiny
    model = tr.TrainModel(cfg, hasher, seed=1)
    tr.export_checkpoint(model, str(tmp_path / "ck"), tok, max_shard_bytes=1 << 20)
    ckpt = load_checkpoint(str(tmp_path / "ck"))  # strict: every manifest tensor, right formats
    assert len(os.listdir(tmp_path / "ck")) > 4  # several shards, index, config, tokenizer
    assert ckpt.tensors["layers.2.ffn.experts.0.w1.weight"].dtype == torch.uint8  # MXFP4
    assert ckpt.tensors["layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    # 300 tokens: past the 128-token window, and top-k 16 of up to 150 entries bites
    diff = tr.check_against_model(model, str(tmp_path / "ck"), _ids(300, cfg.vocab_size, 0))
    assert diff < 1e-3


def test_batched_engram_rows_match_the_hasher(tiny):
    cfg, _, hasher = tiny
    model = tr.TrainModel(cfg, hasher)
    ids = torch.tensor([_ids(40, cfg.vocab_size, 1), _ids(40, cfg.vocab_size, 2)])
    rows = model._engram_rows(ids)
    for spec in cfg.layers:
        if spec.has_engram:
            for b in range(2):
                want = hasher.hash_ids(spec.engram_index, ids[b], [])
                assert torch.equal(rows[spec.layer_id][b], want)


def test_a_few_steps_lower_the_loss_on_real_conversations(tiny):
    from tokenizers import Tokenizer

    from flashpd.model import train_data

    cfg, tok_path, hasher = tiny
    tok = Tokenizer.from_file(tok_path)
    convs = train_data.split(train_data.load_conversations())[0][:4]
    rows = tr.make_rows(
        train_data.encode_all(tok, [train_data.chat_text(c) for c in convs]), 128, 0, train_data.PAD_TOKEN_ID
    )
    batch = rows[:2]
    assert batch[:, 0].tolist() == [0, 0]  # every row starts with BOS
    torch.manual_seed(0)
    model = tr.TrainModel(cfg, hasher, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        logits, aux = model(batch, want_aux=True)
        loss, count = tr.loss_fn(logits, batch, train_data.PAD_TOKEN_ID)
        opt.zero_grad()
        (loss + aux).backward()
        opt.step()
        model.update_routing_bias()
        losses.append(loss.item())
    assert count > 100 and torch.isfinite(aux)
    assert losses[-1] < losses[0] - 0.5
    # the indexer's own parameters learn only from the indexer loss
    assert model.raw("layers.2.attn.indexer.wq_b.weight").grad is not None


def test_cli_trains_exports_and_the_engine_generates(tmp_path):
    from flashpd.cli import main
    from flashpd.engine.llm_engine import EngineConfig
    from flashpd.engine.loading import load_engine
    from flashpd.engine.sampling import SamplingParams

    out = str(tmp_path / "run")
    assert (
        main(
            [
                "train",
                "--preset",
                "tiny",
                "--out",
                out,
                "--steps",
                "2",
                "--batch",
                "2",
                "--seq-len",
                "64",
                "--limit-conversations",
                "3",
                "--eval-rows",
                "2",
                "--device",
                "cpu",
                "--quiet",
            ]
        )
        == 0
    )
    log = json.load(open(os.path.join(out, "train_log.json")))
    assert log["steps"] == 2 and log["heldout_loss"] is not None
    engine = load_engine(out, EngineConfig(model_id="t"))
    engine.add_request("r", [0, 3, 100, 200, 4], SamplingParams(max_tokens=5, ignore_eos=True))
    got = []
    while engine.has_unfinished():
        for o in engine.step():
            got.extend(o.new_token_ids)
    assert len(got) == 5


def test_train_needs_a_budget():
    from flashpd.cli import main

    with pytest.raises(SystemExit, match="--steps or --minutes"):
        main(["train", "--preset", "tiny", "--out", "/nonexistent"])
