"""The stack bench's reference side (bench/h200_stack.py): the P/D reference engines get the
replicas' own engine settings, and the HTTP check compares against streamed text."""

from __future__ import annotations

import os

from flashpd.bench.h200_stack import stack_engine_configs, streamed_text
from flashpd.model.presets.small import checkpoint_path

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_reference_engines_are_built_from_the_serve_config():
    cfgs = stack_engine_configs(os.path.join(ROOT, "infra", "serve.h200.yaml"))
    assert cfgs["prefill"].role == "prefill" and cfgs["decode"].role == "decode"
    assert (cfgs["prefill"].num_blocks, cfgs["prefill"].max_num_seqs) == (24576, 8)
    assert (cfgs["decode"].num_blocks, cfgs["decode"].num_slots, cfgs["decode"].max_num_seqs) == (32768, 64, 64)
    assert cfgs["decode"].max_model_len == cfgs["prefill"].max_model_len == 139264
    assert cfgs["decode"].swa_bounded_replay and cfgs["decode"].async_scheduling


def test_streamed_text_holds_split_characters_like_the_router():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(checkpoint_path(), "tokenizer.json"))
    ids = tok.encode("naïve café — 東京 🚀 done", add_special_tokens=False).ids
    assert streamed_text(tok, ids) == tok.decode(ids, skip_special_tokens=True)


def test_http_greedy_prompts_reach_the_stack_cold():
    """The HTTP check sends a prompt of its own (same length, other ids) after the gRPC one: the
    same prompt again would be a prefix hit, a different compute path from the reference's."""
    from flashpd.bench import h200_stack as hs

    for i, (name, n) in enumerate(hs.CHECK_PROMPTS.items()):
        grpc, http = hs.prompt_ids(n, 100 + i), hs.http_prompt(name, n, i)
        assert len(http) == n and http[:128] != grpc[:128]  # not even a first block shared
        assert hs.http_name(name) != name
