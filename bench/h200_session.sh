#!/usr/bin/env bash
# One H200 session's measurements in one call, inside a fixed time box (the device's per-call limit):
#   FLASHPD_COMMIT=<sha> bash bench/h200_session.sh OUT [SECONDS] [PHASES]
#   PHASES: any of "check moe dense decode fused indexer attn measure final wave tests reference drafter roofline" (default "check measure"); moe and dense time the
#   variants built without a GPU run (each ~5 min: one call each)
#   (the device copy's git metadata can be stale: pass the commit measured)
# check: steps 2, 3, 5 and the host-step benchmark on the device; measure: steps 4 and 6
# (the routed-expert bounds, FLASHPD_MOE_GEMV_MAX_ROWS / FLASHPD_MOE_SWAPAB_MAX_TOKENS, come from
# the environment or the module defaults)
# 1. install this tree into a fresh target (a warm machine keeps old installs under /tmp)
# 2. routed-expert GEMV check at decode sizes (moe_gemv_check.md) and the sampler's cost
# 3. verify-kernels (every op, bench shapes, against the torch references)
# 4. gpu_engine --summary (summary.json), 5. the GPU-path tests (gpu_tests.txt; after the
#    summary in a measure-only call), 6. the decode/prefill profile
# Each step gets what is left of the box; everything lands in OUT (log.txt holds the output).
set -u
OUT=${1:?OUT}; BOX=${2:-560}; PHASES=${3:-check measure}
gpu_tests() {  # $1: seconds to leave for what follows
    echo "== GPU-path tests ($(left) s left)"
    timeout $(( $(left) - $1 )) python -m pytest -q -m "not soak" --tb=short --rootdir "$REPO" \
        "$REPO/tests/engine/gpu" > "$OUT/gpu_tests.txt" 2>&1
    grep -E "passed|failed|Error|error" "$OUT/gpu_tests.txt" | tail -12
}
has() { case " $PHASES " in *" $1 "*) return 0;; esac; return 1; }
START=$(date +%s)
left() { echo $(( BOX - ($(date +%s) - START) )); }
mkdir -p "$OUT"; exec > >(tee -a "$OUT/log.txt") 2>&1
REPO=$(pwd)
D=/tmp/fp$RANDOM$RANDOM
pip install -q --no-deps --no-index --no-build-isolation --target "$D" . || exit 1
export PYTHONPATH=$D PYTHONUNBUFFERED=1 FLASHPD_COMMIT=${FLASHPD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -f .tcache/tcache.tgz ]; then mkdir -p ~/.triton && tar xzf .tcache/tcache.tgz -C ~/.triton; fi
cd /tmp
if has check; then
echo "== host step on the device ($(left) s left)"
timeout 60 python "$REPO/benchmarks/host_step.py" --device cuda --batch 1 8 64 --context 8192 --steps 20
echo "== gemv check ($(left) s left)"
timeout 70 python "$REPO/benchmarks/moe_gemv_check.py" --out "$OUT" --budget-s 5
echo "== sampler ($(left) s left)"
timeout 60 python -m flashpd.bench.sampler_bench --batch 1 64
echo "== verify-kernels ($(left) s left)"
timeout 90 python -m flashpd.cli verify-kernels --no-timing 2>&1 | tail -40
gpu_tests 10
fi
if has moe; then  # variants built without a GPU run: MoE sizes, mHC, router / sort
echo "== swap-AB experts at 1-16 tokens ($(left) s left)"
timeout 130 python "$REPO/benchmarks/moe_swapab_check.py" --out "$OUT" --ms 1 2 4 8 16 --budget-s 100
echo "== mHC variants ($(left) s left)"
timeout 140 python "$REPO/benchmarks/mhc_bench.py" --no-prefill-variants --big 4096 --out "$OUT"
echo "== pair sort ($(left) s left)"
timeout 60 python "$REPO/benchmarks/moe_route_bench.py" --sort-only --out "$OUT"
fi
if has dense; then  # FP8 decode GEMM variants (dense_fp8.md), prefill attention V split
echo "== FP8 decode GEMM variants ($(left) s left)"
timeout 200 python "$REPO/benchmarks/gemm_decode.py" --out "$OUT" --kinds fp8 --warm-procs 15 \
    --warm-timeout-s 80 --budget-s 150 --variants new f8_deq_swap_bn256_r4_o16bn128 \
    f8_deq_swap_bn128_r4_o16noswap f8_deq_bn256_r4_o16bn128 f8_deq_o16r4 \
    f8_deq_swap_bn128_o16r4 f8_deq_bn128_o16r4 f8_deq_swap_o16r4 f8_deq f8_deq_pdl_o16r4 \
    f8_deq_t528_o16r4 f8_deq_t132_o16r4 f8_deq_s6_o16r4 f8_deq_swap_bn128_pdl_o16r4 \
    f8_deq_o16r4w8
echo "== attention V split ($(left) s left)"
timeout 150 python "$REPO/benchmarks/attention_bench.py" --prefill-t 8192 --jobs 8 --budget-s 95 \
    --variants default heads_bn64 vsplit_bn32_w4 vsplit_bn16_w4 vsplit_bn64_w4 vsplit_bn32_w8 \
    vsplit_bn16_w8 vsplit_bn64_w8 --verify vsplit_bn32_w4 vsplit_bn32_w8 \
    --out "$OUT/attn_vsplit.json"
fi
if has decode; then  # decode steps only, async scheduling on then off, and the GPU-path tests
echo "== decode, async vs sync ($(left) s left)"
timeout $(( $(left) - 200 )) python -m flashpd.bench.gpu_engine --decode-only --compare-sync \
    --commit "$FLASHPD_COMMIT" --out "$OUT"
gpu_tests 5
fi
if has fused; then  # the launch fusions built without a GPU (off by default): kernels, then the engine
echo "== attention fused combine ($(left) s left)"
timeout 150 python "$REPO/benchmarks/attention_bench.py" --fused-combine --jobs 6 --budget-s 120 \
    --out "$OUT/attn_fused_combine.json"
echo "== MoE fused gate ($(left) s left)"
timeout 90 python "$REPO/benchmarks/moe_route_bench.py" --fused --tokens 1 2 4 8 16 32 64 --out "$OUT"
echo "== decode with both fusions on ($(left) s left)"
FLASHPD_ATTN_FUSED_COMBINE=1 FLASHPD_MOE_FUSED_GATE=1 timeout $(( $(left) - 100 )) \
    python -m flashpd.bench.gpu_engine --decode-only --commit "$FLASHPD_COMMIT" --out "$OUT/fused"
FLASHPD_ATTN_FUSED_COMBINE=1 FLASHPD_MOE_FUSED_GATE=1 gpu_tests 5
fi
if has indexer; then  # small-batch indexer launches: kernels on/off, checks, decode off/on, tests
echo "== indexer score + top-k, small-batch forms off/on ($(left) s left)"
timeout 100 python "$REPO/benchmarks/indexer_bench.py" --out "$OUT"
timeout 90 python -m flashpd.cli verify-kernels --ops indexer --no-timing 2>&1 | tail -12
echo "== decode, small-batch indexer off ($(left) s left)"
FLASHPD_INDEXER_SMALL_BATCH=0 timeout 170 python -m flashpd.bench.gpu_engine --decode-only \
    --commit "$FLASHPD_COMMIT" --out "$OUT/indexer_off"
echo "== decode, small-batch indexer on ($(left) s left)"
timeout $(( $(left) - 95 )) python -m flashpd.bench.gpu_engine --decode-only \
    --commit "$FLASHPD_COMMIT" --out "$OUT/indexer_on"
gpu_tests 5
fi
if has attn; then  # decode attention's split-KV combine width / split count: sweep, pick, summary
echo "== decode attention variants ($(left) s left)"
timeout 170 python "$REPO/benchmarks/attention_bench.py" --decode-only --jobs 7 --budget-s 140 \
    --variants default c1 c2 c8 mt2 mt4 mt2_c1 mt2_c2 sh8 sh8_mt2_c1 bn32 bn32_c1 t132 t132_c1 \
    --out "$OUT/attn_decode.json" --pick-out "$OUT/attn_pick.json" | tail -50
PICK=$(cat "$OUT/attn_pick.json" 2>/dev/null || echo '{}')
echo "== decode with FLASHPD_ATTN_CONFIG=$PICK ($(left) s left)"
FLASHPD_ATTN_CONFIG="$PICK" timeout $(( $(left) - 100 )) python -m flashpd.bench.gpu_engine \
    --summary --commit "$FLASHPD_COMMIT" --out "$OUT/attn_pick"
FLASHPD_ATTN_CONFIG="$PICK" gpu_tests 5
fi
if has final; then  # a short box: the summary, then the GPU-path tests with what is left (no profile)
echo "== summary ($(left) s left)"
timeout $(( $(left) - 60 )) python -m flashpd.bench.gpu_engine --summary --commit "$FLASHPD_COMMIT" \
    --out "$OUT"
gpu_tests 3
fi
if has wave; then  # one call: no stall at a new shape (+ decode 1/8/64), kernels, speculation's batches
echo "== first hit at a new width, decode ($(left) s left)"
timeout 230 python -m flashpd.bench.gpu_engine --first-hit --commit "$FLASHPD_COMMIT" --out "$OUT"
echo "== verify-kernels ($(left) s left)"
timeout 100 python -m flashpd.cli verify-kernels --no-timing 2>&1 | tail -12
echo "== speculative decoding, forced acceptance ($(left) s left)"
FLASHPD_BENCH_FORCED_ACCEPTANCE=1 timeout $(( $(left) - 3 )) python -m flashpd.bench.spec_decode \
    --device cuda --preset bench --context 8192 --batches 1 8 16 32 64 --steps 12 --no-greedy-check \
    --commit "$FLASHPD_COMMIT" --out "$OUT/spec.json" 2>&1 | grep -v "^ " | tail -20
fi
if has tests; then gpu_tests 2; fi
if has reference; then  # the P/D greedy reference for the stack bench (needs xgrammar: .whl carried)
echo "== P/D greedy reference ($(left) s left)"
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    pip install -q --no-index --no-deps --no-compile --target "$D-wheels" "$REPO"/.whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$D-wheels"
fi
timeout $(( $(left) - 3 )) python -m flashpd.bench.h200_stack --out "$OUT" --phase reference 2>&1 | tail -5
fi
if has drafter; then  # the small checkpoint's DSpark drafter (issue 26): .data/ carries the ShareGPT subset
echo "== DSpark drafter for small ($(left) s left)"
DATA=${FLASHPD_DRAFTER_DATA:-$REPO/.data/sgpt_sub.json.gz}  # python -m flashpd.model.train_data subset
DOUT=/tmp/small_dspark$RANDOM
BASE=$REPO/model/presets/small_checkpoint  # the installed package carries no weights
timeout 120 python -m flashpd.cli train --drafter --preset small --base "$BASE" --out "$DOUT-smoke" --steps 3 --batch 2 \
    --seq-len 128 --teacher-rows 4 --eval-prompts 1 --eval-tokens 8 --device cuda --data "$DATA" --quiet \
    || echo "drafter smoke FAILED"
MIN=${FLASHPD_DRAFTER_MINUTES:-$(( ($(left) - 150) / 60 ))}
timeout $(( $(left) - 20 )) python -m flashpd.cli train --drafter --preset small --base "$BASE" --out "$DOUT" \
    --minutes "$MIN" --device cuda --seq-len 1024 --batch 16 --teacher-rows 1024 --blocks-per-row 16 \
    --eval-prompts 32 --eval-tokens 128 --log-every 100 --data "$DATA"
tar czf "$OUT/small_dspark.tgz" -C "$DOUT" --exclude 'model-*' --exclude tokenizer.json . 2>/dev/null
fi
if has roofline; then  # the per-kernel roofline table at the current defaults (and the old kernels)
echo "== kernel roofline ($(left) s left)"
timeout $(( $(left) - 5 )) python -m flashpd.bench.kernel_roofline --out "$OUT" \
    --variants after --budget-s $(( $(left) - 40 )) 2>&1 | tail -60
fi
has measure || { echo "== done ($(left) s left)"; exit 0; }
echo "== summary ($(left) s left; FLASHPD_MOE_GEMV_MAX_ROWS=${FLASHPD_MOE_GEMV_MAX_ROWS:-default})"
timeout $(( $(left) - 150 )) python -m flashpd.bench.gpu_engine --summary --commit "$FLASHPD_COMMIT" --out "$OUT"
gpu_tests 90
echo "== profile ($(left) s left)"
timeout $(( $(left) - 5 )) python -m flashpd.bench.gpu_profile --batch 1 64 --steps 2 \
    --prefill 8192 --out "$OUT" > "$OUT/profile_log.txt" 2>&1
tail -5 "$OUT/profile_log.txt"
if [ -n "${TCACHE_OUT:-}" ]; then tar czf "$OUT/tcache.tgz" -C ~/.triton cache; fi  # next call's
echo "== done ($(left) s left)"
