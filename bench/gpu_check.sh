#!/usr/bin/env bash
# Every GPU test and benchmark the project has, in one command, for a session
# that is lent a GPU (the device tool): under 10 minutes, a short table at the end.
# Here: `bench/pack_gpu_kit.sh` (the build tree is too large to carry); then `run` with
# carry: ["gpu-kit"] and command `bash bench/gpu_check.sh gpu-kit`.
#
# What it runs on the GPU:
#  - every example graph and the graph of every templated op, with `cudagen run --gpu`:
#    NVRTC for the device's architecture, launched through the driver API, each output
#    (and each training step's weights) checked against the float64 reference;
#  - the same with --cuda-graph, and the training examples for several steps;
#  - examples/jit (the C++ API), and the disk cache's second run (a hit);
#  - examples/aot, built ahead of time with nvcc by pack_gpu_kit.sh;
#  - the numerical tests of the emitter (every op forward and backward, f32/f16/bf16, sizes that
#    are not multiples of a block, fused chains, training steps) with CUDAGEN_TEST_BACKEND=gpu;
#  - the profile of the forward and training examples (--profile): kernel and phase times, bandwidth
#    against the device copy, FLOP rates; the profile tables at the end;
#  - the megakernel mode (--megakernel, docs/megakernel.md): the examples checked, training for
#    several steps on counters never reset, the numerical tests compiled as megakernels, and
#    bench_megakernel's table (a GPT-2-sized decoder block and a 12-block stack at batch 1, 64
#    tokens, and the MLP training step: kernels, CUDA Graph, megakernel) beside PyTorch eager and
#    torch.compile(mode="reduce-overhead") on the same block (bench/decoder_torch.py);
#  - the PyTorch frontend's tests on the machine's PyTorch 2.x: the torch.export path and
#    F.scaled_dot_product_attention, which CI's PyTorch 1.13 lacks;
#  - the GEMM mainloops (templates/gemm.cuh) against cuBLAS at 4096^3 and a decoder block's shapes:
#    the bf16 pipelined one in every tile config, the f32 SIMT one against SGEMM (FP32 math), the
#    pipelined one on f32 as TF32 (--allow-tf32) against cuBLAS in TF32 math on fresh f32 values
#    (the check of its rounding: half an ulp added, the tensor core truncating), each result
#    checked (bench/gemm/gemm_bench.cu), and under compute-sanitizer (memcheck, racecheck,
#    synccheck);
#  - the Hopper mainloop (templates/gemm_sm90.cuh: TMA, mbarriers, wgmma; sm_90a) against cuBLAS at
#    4096^3 and a decoder block's shapes, each result checked (bench/gemm/hopper_bench.cu), and under
#    compute-sanitizer (memcheck, racecheck, synccheck);
#  - the same decoder block at B1 x T64 in bf16 (split-K on its projections): prediction and profile;
#  - flash attention alone (bench/attention_graph.py) at B8 x H12 x T 512/2048/8192, heads of 64, causal and
#    not, beside PyTorch's SDPA on its flash backend (bench/attention_torch.py); then trained (--train: the
#    forward and the backward kernel) beside SDPA's forward and backward; grouped-query attention (32
#    query heads over 8, heads of 128, T2048 causal) forward and trained beside SDPA's enable_gqa; f32
#    attention as TF32 (--allow-tf32), forward and trained, beside SDPA's efficient backend in f32 with
#    TF32 allowed, and f32 trained exact (CUDA cores) beside SDPA with allow_tf32 off; heads of 256
#    (bf16, B8 x H8 x T2048 causal) forward and trained beside SDPA;
#  - flash attention's Hopper kernels (sm_90a, issue #39) against part 1's (--arch sm_90) on the same
#    GPU, heads of 64 and 128, T2048/8192: the forward causal and not, a training step causal;
#    decoding over 8192 keys (split-KV), heads of 32 (padded to 64 on the Hopper kernel) and heads
#    of 256 forward and trained;
#  - ResNet-50 forward in bf16 at batch 1 and 32 (224 x 224), exported channels-last by the torch
#    frontend (its convolutions on the implicit GEMM), beside PyTorch eager (cuDNN) and torch.compile
#    (bench/resnet_torch.py); the gradients of six of its convolutions (dx and dweight, batch 32) beside
#    PyTorch's convolution backward (bench/conv_gradients.py); BatchNorm in training mode forward and
#    backward on six of its activations beside PyTorch's (bench/batchnorm_bench.py);
#  - a GPT-2-small decoder block at B8 x T128 in bf16 (generated matmuls on that mainloop) beside
#    PyTorch in bf16: the performance model's prediction per kernel (describe) and the measured
#    profile, and Nsight Compute's speed-of-light, memory and occupancy sections for three kernels.
# Each check's row gives its seconds; the benchmarks at the end are skipped, visibly, where the
# script would run past the device tool's 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
kit=${1:-gpu-kit}
[[ -x "$kit/bin/cudagen" ]] || { echo "no $kit/bin/cudagen: run bench/pack_gpu_kit.sh first, and carry $kit"; exit 2; }
export LD_LIBRARY_PATH="$PWD/$kit/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cudagen="$kit/bin/cudagen"
rows=()
device=$(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -1)
rows+=("device|${device:-no GPU visible}")
export CUDAGEN_CACHE_DIR=$(mktemp -d)
log=$(mktemp -d)
# Under the device tool, every check's log and profile come back with the reply ($OUT).
trap '[[ -n ${OUT:-} ]] && cp -r "$log" "$OUT/gpu-check-logs"' EXIT

# The device tool stops a command at 10 minutes: every check and benchmark past `budget`
# seconds is skipped, visibly, and each row is printed as it lands (the table is printed
# again at the end) so that a run cut short still says what passed.
# GPU_CHECK_BUDGET lowers it where less device time is left; GPU_CHECK_ONLY (an extended regular
# expression on the check and benchmark names) runs a part, e.g. after a call that was cut short.
budget=${GPU_CHECK_BUDGET:-560}
only=${GPU_CHECK_ONLY:-}
selected() { [[ -z $only ]] || grep -Eq "$only" <<< "$1"; }
have_time() {  # SECONDS_IT_TAKES NAME
  if ! selected "$2"; then echo "skipped: $2 (not selected by GPU_CHECK_ONLY=$only)"; return 1; fi
  if (( SECONDS + $1 > budget )); then echo "skipped: $2 (${SECONDS} s gone, it takes about $1 s)"; return 1; fi
}
check() {  # NAME COMMAND...: one row, ok or FAILED with the last lines of the output, and its seconds
  local name=$1 started=$SECONDS; shift
  if ! selected "$name"; then rows+=("$name|skipped (not selected by GPU_CHECK_ONLY)"); return; fi
  if "$@" >"$log/out" 2>&1; then
    rows+=("$name|ok ($((SECONDS - started)) s) $(grep -Eo 'cache [a-z ()]+' "$log/out" | head -1)")
  else
    rows+=("$name|FAILED ($((SECONDS - started)) s): $(tail -c 400 "$log/out" | tr '\n' ' ')")
  fi
  local row=${rows[-1]}
  printf '%-50s %s\n' "${row%%|*}" "${row#*|}"
  cp "$log/out" "$log/$(echo "$name" | tr -c 'a-zA-Z0-9_.-' '_').log"
}
# The numerical tests compile a module a test with NVRTC, a core each: in gtest shards at once on
# the device machine's 16 cores (one GPU between them), a fifth of the time of one process (279 s
# on an H100 on 2026-11-27, which left no time for the benchmarks).
sharded() {  # SHARDS COMMAND...: the command's tests as SHARDS processes at once; fails where one does
  local shards=$1 status=0 i pids=()
  shift
  for ((i = 0; i < shards; ++i)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i "$@" > "$log/shard.$i" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || status=1
    cat "$log/shard.$i"
  done
  return $status
}
timed_check() {  # SECONDS_IT_TAKES NAME COMMAND...: check, where the budget allows it
  local seconds=$1; shift
  if have_time "$seconds" "$1" > "$log/skip"; then check "$@"; else rows+=("$1|$(cat "$log/skip")"); fi
}

for graph in examples/mlp_forward.json examples/transformer_block.json tests/snapshots/every_template_op.json \
             examples/mlp_derived.json; do
  check "run --gpu $(basename "$graph")" "$cudagen" run --gpu "$graph"
  check "run --gpu --cuda-graph $(basename "$graph")" "$cudagen" run --gpu --cuda-graph "$graph"
done
check "run --gpu --check-each-task train_transformer" "$cudagen" run --gpu --check-each-task examples/train_transformer.json
check "train_mlp --steps 20 --step-function" "$cudagen" run --gpu --steps 20 --step-function examples/train_mlp.json
check "train_transformer --steps 5" "$cudagen" run --gpu --steps 5 examples/train_transformer.json
# A decoder block's training step at heads of 64 over 64 tokens: the attention's gradients in one
# kernel at that rule's bound, the q/k/v input gradients as one sum of matmuls.
python3 bench/decoder_graph.py --train --dim 256 --heads 4 --mlp 1024 --tokens 64 -o "$log/train_decoder1.json"
check "train_decoder1 (heads of 64) --steps 3" "$cudagen" run --gpu --steps 3 "$log/train_decoder1.json"
# The same block under the bf16 precision policy (#41): f32 master weights, products in bf16.
python3 bench/decoder_graph.py --train --dtype bf16 --dim 256 --heads 4 --mlp 1024 --tokens 64 -o "$log/train_decoder1_bf16.json"
check "train_decoder1, precision bf16, --steps 3" "$cudagen" run --gpu --steps 3 "$log/train_decoder1_bf16.json"
# ...and in f16 with dynamic loss scaling (#41).
python3 bench/decoder_graph.py --train --dtype f16 --dim 256 --heads 4 --mlp 1024 --tokens 64 -o "$log/train_decoder1_f16.json"
check "train_decoder1, precision f16 (loss scaled), --steps 3" "$cudagen" run --gpu --steps 3 "$log/train_decoder1_f16.json"
# ...and with gradient accumulation and clipping (#41): 3 steps of 2 micro-batches.
python3 bench/decoder_graph.py --train --accumulate-gradients --clip-grad-norm 1.0 --dim 256 --heads 4 --mlp 1024 \
  --tokens 64 -o "$log/train_decoder1_accumulated.json"
check "train_decoder1, accumulated and clipped, --steps 3 --micro-batches 2" \
  "$cudagen" run --gpu --steps 3 --micro-batches 2 "$log/train_decoder1_accumulated.json"
# The same graph and options as the train_mlp row above: the disk cache must answer.
cache_hit() { "$@" && grep -q 'cache hit' "$log/out" 2>/dev/null || { echo "no cache hit on the second run"; false; }; }
check "train_mlp again (must be a cache hit)" cache_hit "$cudagen" run --gpu --steps 2 --step-function examples/train_mlp.json
check "examples/jit (C++ API)" "$kit/bin/jit_mlp" examples/mlp_forward.json
check "examples/aot (nvcc, ahead of time)" "$kit/bin/aot_mlp"
for graph in examples/mlp_forward.json examples/transformer_block.json tests/snapshots/every_template_op.json; do
  check "run --gpu --megakernel $(basename "$graph")" "$cudagen" run --gpu --megakernel "$graph"
done
check "train_transformer --steps 5 --megakernel" "$cudagen" run --gpu --megakernel --steps 5 examples/train_transformer.json
gpu_tests='*EmulatedOps.*:*EmulatedHalfOps.*:*FusedChains.*:Fusion.*:TrainingRun.*:RunTimeArgs.ADerivedAdam*'
gpu_tests+=':RunTimeArgs.Reduction*:Derive.ADerived*:Emulation.TensorCore*:Emulation.Unfused*:Emulation.ReshapeIsAView*'
gpu_tests+=':Emulation.InPlace*:Emulation.MlpTraining*:Emulation.TransformerBlock*'
gpu_tests+=':Emulation.PipelinedMatmul*:Emulation.HopperMatmul*:Emulation.GridsOver*:FlashAttention.*:*ChannelsLast*'
gpu_tests+=':Autocast.*:Derive.Clipping*:Derive.Accumulated*:Derive.LossScaling*'
check "numerical tests on the GPU (CUDAGEN_TEST_BACKEND=gpu)" \
  sharded 8 env CUDAGEN_TEST_BACKEND=gpu CUDAGEN_SOURCE_DIR="$PWD" "$kit/bin/cudagen_emulation_tests" --gtest_filter="$gpu_tests" --gtest_brief=1

# As megakernels: the fused chains and the training steps (all of the above took 110 s on an
# H200 on 2026-11-25, which with the rest ran the script past 10 minutes).
timed_check 60 "numerical tests as megakernels on the GPU" \
  sharded 8 env CUDAGEN_TEST_BACKEND=gpu CUDAGEN_TEST_MEGAKERNEL=132 CUDAGEN_SOURCE_DIR="$PWD" "$kit/bin/cudagen_emulation_tests" \
  --gtest_filter='*FusedChains.*:TrainingRun.*:Emulation.MlpTraining*:Emulation.TransformerBlock*' --gtest_brief=1

# The PyTorch frontend on this machine's PyTorch (2.x): the torch.export path, and SDPA.
torch_version=$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)
timed_check 60 "torch frontend tests, PyTorch ${torch_version:-missing} (torch.export)" \
  env CUDAGEN_TEST_RUN_MODE=--gpu python3 tests/torch_frontend/test_frontend.py "$cudagen"

# The GEMM mainloop against cuBLAS in this process (its table is printed at the end).
export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/usr/local/cuda/lib64"
timed_check 60 "gemm_bench: every config and shape checked" \
  sh -c "\"$kit/bin/gemm_bench\" > \"$log/gemm.txt\" 2>&1 || { tail -4 \"$log/gemm.txt\"; exit 1; }"
timed_check 40 "compute-sanitizer memcheck: gemm_bench --quick" compute-sanitizer --tool memcheck --error-exitcode 1 \
  "$kit/bin/gemm_bench" --quick
# The mainloop's shared memory: no race between a stage's copies and its readers, no barrier
# misuse (the emulator checks the same in CI: docs/architecture.md §8).
timed_check 60 "compute-sanitizer racecheck: gemm_bench --quick" compute-sanitizer --tool racecheck --error-exitcode 1 \
  "$kit/bin/gemm_bench" --quick
timed_check 40 "compute-sanitizer synccheck: gemm_bench --quick" compute-sanitizer --tool synccheck --error-exitcode 1 \
  "$kit/bin/gemm_bench" --quick
# The Hopper mainloop (templates/gemm_sm90.cuh: TMA, mbarriers, wgmma) against cuBLAS, each shape
# checked; the emulator's model of TMA and wgmma meets the hardware here first. Then the sanitizers.
timed_check 60 "hopper_bench: wgmma mainloop checked against cuBLAS" \
  sh -c "\"$kit/bin/hopper_bench\" > \"$log/hopper.txt\" 2>&1 || { tail -4 \"$log/hopper.txt\"; exit 1; }"
for tool in memcheck racecheck synccheck; do
  timed_check 40 "compute-sanitizer $tool: hopper_bench --quick" compute-sanitizer --tool $tool --error-exitcode 1 \
    "$kit/bin/hopper_bench" --quick
done

# The benchmarks below print tables, not checks: each runs only while the whole script stays
# inside the device tool's 10 minutes (it says so where it skips one).
echo
printf '%-50s %s\n' "check" "result"
for r in "${rows[@]}"; do printf '%-50s %s\n' "${r%%|*}" "${r#*|}"; done

echo
echo "profiles (cudagen run --gpu --profile: median of 10 runs after warm-up; the kernel times must add up to"
echo "within 10% of the phase's):"
for graph in examples/mlp_forward.json examples/transformer_block.json examples/train_transformer.json; do
  have_time 15 "the profile of $graph" || continue
  echo "== $graph"
  "$cudagen" run --gpu --profile "$log/$(basename "$graph" .json).profile.json" "$graph" 2>&1 | sed -n '/^profile of/,$p'
done
# Rows of bench_megakernel (graph, ms in column 4) beside rows of bench/attention_torch.py (ms
# sixth from the end), line by line: the ratio is torch time / cudagen time. SUFFIX ends each row.
beside_torch() {  # CUDAGEN_ROWS TORCH_ROWS [SUFFIX]
  paste <(awk '{print $1, $4}' "$1") <(awk '{print $(NF-5)}' "$2") |
    awk -v suffix="${3:-}" '{ printf "%-46s cudagen %8.4f ms  torch %8.4f ms  ratio %.2fx%s\n", $1, $2, $3, $3 / $2, suffix }'
}
echo
echo "flash attention (issue #37, docs/attention.md), forward, bf16, B8 x H12, heads of 64, then one decoding step: the generated kernel"
echo "(bench_megakernel, kernels only, mean of 20 runs on random inputs) beside PyTorch's SDPA on its flash backend"
echo "(median of 20); ratio = torch time / cudagen time:"
if have_time 60 "the flash attention benchmark"; then
  for tokens in 512 2048 8192; do
    for causal in "" --causal; do
      python3 bench/attention_graph.py --tokens $tokens $causal -o "$log/attention_${tokens}${causal}.json"
      "$kit/bin/bench_megakernel" --modes kernels --runs 20 "$log/attention_${tokens}${causal}.json" 2>&1 | sed -n 2p
    done
  done | tee "$log/attention_cudagen.txt"
  # Decoding: one query row a head over a cache of 8192 keys (split-KV).
  python3 bench/attention_graph.py --queries 1 --tokens 8192 -o "$log/attention_decode.json"
  "$kit/bin/bench_megakernel" --modes kernels --runs 20 "$log/attention_decode.json" 2>&1 | sed -n 2p |
    tee -a "$log/attention_cudagen.txt"
  python3 bench/attention_torch.py --tokens 512 2048 8192 --decode 8192 --runs 20 2>&1 | tee "$log/attention_torch.txt"
  beside_torch "$log/attention_cudagen.txt" "$log/attention_torch.txt"
fi
echo
echo "flash attention's Hopper kernels (issue #39, docs/attention.md \"The Hopper path\"; sm_90a, the GPU's own target)"
echo "against part 1's kernel on the same GPU (--arch sm_90: mma.sync), bf16, B8 x H12, heads of 32 to 256,"
echo "kernels only, mean of 20; ratio = part 1's time / the Hopper kernel's (SDPA's times: the table above):"
if have_time 60 "the Hopper flash attention benchmark"; then
  # One row: the graph that attention_graph.py writes from the arguments after the row's name,
  # timed on the Hopper kernels and on part 1's (--step where trained: the forward, the rows'
  # statistics and the backward kernel).
  hopper_row() {
    local name=$1 g="$log/attention_hopper_row.json" step=
    shift
    case " $* " in *" --train "*) step=--step ;; esac
    python3 bench/attention_graph.py "$@" -o "$g"
    local hopper part1
    hopper=$("$kit/bin/bench_megakernel" --modes kernels --runs 20 $step "$g" 2>&1 | sed -n 2p | awk '{print $4}')
    part1=$("$kit/bin/bench_megakernel" --modes kernels --runs 20 --arch sm_90 $step "$g" 2>&1 | sed -n 2p | awk '{print $4}')
    awk -v n="$name" -v h="$hopper" -v p="$part1" \
      'BEGIN { printf "%-30s Hopper %8.4f ms  part 1 %8.4f ms  ratio %.2fx\n", n, h, p, p / h }'
  }
  for head in 64 128; do
    for tokens in 2048 8192; do
      for causal in "" --causal; do
        hopper_row "heads $head T$tokens${causal:+ causal}" --tokens $tokens --head $head $causal
      done
    done
  done
  # Decoding (one query row a head over 8192 keys, B8 x H12: split-KV on both), heads of 32
  # (padded to 64 on the Hopper kernel) at T2048, and heads of 256 (Gemma's: 64 keys a step
  # forward, two key blocks a tile of keys and 32 rows a step trained).
  hopper_row "decoding heads 64 T8192" --queries 1 --tokens 8192 --head 64
  hopper_row "heads 32 T2048 causal" --tokens 2048 --head 32 --causal
  hopper_row "heads 256 T2048 causal" --tokens 2048 --head 256 --causal
  hopper_row "trained heads 256 T2048 causal" --train --tokens 2048 --head 256 --causal
  # Trained, causal.
  for head in 64 128; do
    for tokens in 2048 8192; do
      hopper_row "trained heads $head T$tokens causal" --train --tokens $tokens --head $head --causal
    done
  done
fi
echo
echo "flash attention trained (issue #37): the forward and the backward kernel (deterministic: dq by its own blocks), bf16,"
echo "B8 x H12, heads of 64 (bench_megakernel --step, kernels only, mean of 20), beside SDPA's flash forward and backward"
echo "(median of 20); ratio = torch time / cudagen time:"
if have_time 120 "the flash attention training benchmark"; then
  for tokens in 512 2048 8192; do
    for causal in "" --causal; do
      python3 bench/attention_graph.py --train --tokens $tokens $causal -o "$log/attention_train_${tokens}${causal}.json"
      "$kit/bin/bench_megakernel" --modes kernels --runs 20 --step "$log/attention_train_${tokens}${causal}.json" 2>&1 | sed -n 2p
    done
  done | tee "$log/attention_train_cudagen.txt"
  python3 bench/attention_torch.py --train --tokens 512 2048 8192 --runs 20 2>&1 | tee "$log/attention_train_torch.txt"
  beside_torch "$log/attention_train_cudagen.txt" "$log/attention_train_torch.txt"
  echo "the atomic mode (--atomic-attention-backward: dq summed with atomics by the key blocks, not bit-identical):"
  for tokens in 512 2048 8192; do
    for causal in "" --causal; do
      "$kit/bin/bench_megakernel" --modes kernels --runs 20 --atomic-attention-backward \
        --step "$log/attention_train_${tokens}${causal}.json" 2>&1 | sed -n 2p
    done
  done | tee "$log/attention_train_atomic.txt"
  beside_torch "$log/attention_train_atomic.txt" "$log/attention_train_torch.txt" " (atomic)"
fi
echo
echo "f32 attention as TF32 (--allow-tf32: the flash kernels on m16n8k8), B8 x H12, heads of 64, T2048, causal and not,"
echo "forward, then trained (forward and backward), beside SDPA in f32 on its efficient backend (TF32 allowed);"
echo "ratio = torch time / cudagen time:"
if have_time 90 "the TF32 attention benchmark"; then
  for train in "" --train; do
    for causal in "" --causal; do
      python3 bench/attention_graph.py --dtype f32 --tokens 2048 $causal $train -o "$log/attention_tf32$causal$train.json"
      "$kit/bin/bench_megakernel" --modes kernels --runs 20 --allow-tf32 ${train:+--step} \
        "$log/attention_tf32$causal$train.json" 2>&1 | sed -n 2p
    done > "$log/attention_tf32${train}_cudagen.txt"
    cat "$log/attention_tf32${train}_cudagen.txt"
    python3 bench/attention_torch.py --dtype f32 --tokens 2048 --runs 20 $train 2>&1 | tee "$log/attention_tf32${train}_torch.txt"
    beside_torch "$log/attention_tf32${train}_cudagen.txt" "$log/attention_tf32${train}_torch.txt" "${train:+ (trained)}"
  done
  echo "f32 trained without TF32 (the flash kernels on CUDA cores: each mma as FMAs) beside SDPA in f32 with allow_tf32 off:"
  for causal in "" --causal; do
    "$kit/bin/bench_megakernel" --modes kernels --runs 20 --step "$log/attention_tf32$causal--train.json" 2>&1 | sed -n 2p
  done > "$log/attention_f32_cudagen.txt"
  cat "$log/attention_f32_cudagen.txt"
  python3 bench/attention_torch.py --dtype f32 --no-tf32 --tokens 2048 --runs 20 --train 2>&1 | tee "$log/attention_f32_torch.txt"
  beside_torch "$log/attention_f32_cudagen.txt" "$log/attention_f32_torch.txt" " (trained, exact f32)"
fi
echo
echo "grouped-query attention (LLaMA-3-8B's: 32 query heads over 8 heads of keys and values, heads of 128), bf16,"
echo "B8 x T2048, causal: forward, then forward and backward (dk and dv per query head, then each group's sum),"
echo "beside SDPA with enable_gqa on its flash backend; ratio = torch time / cudagen time:"
if have_time 60 "the grouped-query attention benchmark"; then
  for train in "" --train; do
    python3 bench/attention_graph.py --heads 32 --kv-heads 8 --head 128 --tokens 2048 --causal $train \
      -o "$log/attention_gqa$train.json"
    "$kit/bin/bench_megakernel" --modes kernels --runs 20 ${train:+--step} "$log/attention_gqa$train.json" 2>&1 | sed -n 2p
  done | tee "$log/attention_gqa_cudagen.txt"
  for train in "" --train; do
    python3 bench/attention_torch.py --heads 32 --kv-heads 8 --head 128 --tokens 2048 --runs 20 $train 2>&1 | sed -n 2p
  done | tee "$log/attention_gqa_torch.txt"
  beside_torch "$log/attention_gqa_cudagen.txt" "$log/attention_gqa_torch.txt"
fi
echo
echo "heads of 256 (Gemma's), bf16, B8 x H8 x T2048, causal: forward, then trained (two key blocks a tile of keys, each"
echo "half of dk's and dv's columns), beside SDPA's flash backend; ratio = torch time / cudagen time:"
if have_time 45 "the heads-of-256 attention benchmark"; then
  for train in "" --train; do
    python3 bench/attention_graph.py --heads 8 --head 256 --tokens 2048 --causal $train -o "$log/attention_256$train.json"
    "$kit/bin/bench_megakernel" --modes kernels --runs 20 ${train:+--step} "$log/attention_256$train.json" 2>&1 | sed -n 2p
  done | tee "$log/attention_256_cudagen.txt"
  for train in "" --train; do
    python3 bench/attention_torch.py --heads 8 --head 256 --tokens 2048 --runs 20 $train 2>&1 | sed -n 2p
  done | tee "$log/attention_256_torch.txt"
  beside_torch "$log/attention_256_cudagen.txt" "$log/attention_256_torch.txt"
fi
echo
echo "Nsight Compute on the flash attention backward kernel (T2048, not causal, deterministic): where its time goes"
if command -v ncu >/dev/null && [[ -f $log/attention_train_2048.json ]] && have_time 60 "Nsight Compute on the flash backward"; then
  ncu --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --kernel-name regex:'^k1_dp$' --launch-count 1 \
    "$kit/bin/bench_megakernel" --modes kernels --runs 1 --step "$log/attention_train_2048.json" 2>&1 |
    grep -E '^  [a-z0-9_]+|Duration|Throughput|Occupancy|Registers|Shared Memory|Stall|Warp Cycles|Block Limit|Issued|L1/TEX Hit|Bank' | head -50
fi
echo
echo "generated code at a real size: a GPT-2-small decoder block, B8 x T128, bf16 (matmuls on the pipelined"
echo "mainloop), as kernels and CUDA Graph (its megakernel runs the old tiles: bench_megakernel's third row);"
echo "PyTorch on the same block in bf16"
if have_time 60 "the bf16 decoder block"; then
  python3 bench/decoder_graph.py --batch 8 --tokens 128 --dtype bf16 -o "$log/decoder_bf16.json"
  # The performance model's prediction (made at compile time), then the measured kernels.
  "$cudagen" describe "$log/decoder_bf16.json" 2>&1 | sed -n '/^matmul mainloops/,$p'
  "$cudagen" run --gpu --profile "$log/decoder_bf16.profile.json" "$log/decoder_bf16.json" 2>&1 |
    sed -n '/^kernels by/,$p'
  "$kit/bin/bench_megakernel" --runs 30 "$log/decoder_bf16.json" 2>&1
  python3 bench/decoder_torch.py --batch 8 --tokens 128 --dtype bf16 --runs 30 2>&1 | tail -2
fi
echo
echo "a training step of that block under the bf16 precision policy (issue #41: f32 master weights, products in"
echo "bf16), GPT-2 small at B8 x T512, AdamW: cudagen's kernels (bench_megakernel --step, mean of 20) beside PyTorch"
echo "under torch.autocast, eager and torch.compile (the anchor on an H100: 2.77 ms)"
if have_time 90 "the bf16 training step"; then
  python3 bench/decoder_graph.py --train --dtype bf16 --batch 8 --tokens 512 -o "$log/train_decoder_bf16.json"
  "$kit/bin/bench_megakernel" --modes kernels --runs 20 --step "$log/train_decoder_bf16.json" 2>&1 | tail -2
  python3 bench/decoder_torch.py --train --dtype bf16 --batch 8 --tokens 512 --runs 20 2>&1 | tail -2
fi
echo
echo "the same block at B1 x T64 (64 rows: its projections split K to fill the SMs), bf16, beside PyTorch"
if have_time 30 "the 64-row decoder block"; then
  python3 bench/decoder_graph.py --batch 1 --tokens 64 --dtype bf16 -o "$log/decoder_bf16_64.json"
  "$cudagen" describe "$log/decoder_bf16_64.json" 2>&1 | sed -n '/^matmul mainloops/,$p'
  "$cudagen" run --gpu --profile "$log/decoder_bf16_64.profile.json" "$log/decoder_bf16_64.json" 2>&1 |
    sed -n '/^kernels by/,$p'
  python3 bench/decoder_torch.py --batch 1 --tokens 64 --dtype bf16 --runs 30 2>&1 | tail -2
fi
echo
echo "convolutions (issue #40, docs/gemm.md): ResNet-50 forward in bf16 at 224 x 224, exported channels-last (every"
echo "convolution conv2d_nhwc, the implicit GEMM on the pipelined mainloop), its kernels timed by bench_megakernel (mean of 20),"
echo "beside PyTorch eager (cuDNN, NCHW and channels_last) and torch.compile (bench/resnet_torch.py, mean of 20):"
if have_time 120 "the ResNet-50 benchmark"; then
  for batch in 1 32; do
    python3 bench/resnet_torch.py --batch $batch --export "$log/resnet50_b$batch" > "$log/resnet50_torch_b$batch.txt" 2>&1
    "$cudagen" describe "$log/resnet50_b$batch/graph.json" 2>&1 | grep -E '^  total'
    "$kit/bin/bench_megakernel" --modes kernels --runs 20 "$log/resnet50_b$batch/graph.json" 2>&1 | sed -n 2p
    grep 'ms/step' "$log/resnet50_torch_b$batch.txt" || tail -3 "$log/resnet50_torch_b$batch.txt"
  done
fi
echo
echo "convolution gradients (issue #40, docs/gemm.md): dx and dweight of seven ResNet-50 layers, bf16, batch 32, channels-last,"
echo "as conv2d_nhwc_backward_data and _weight (bench_megakernel, kernels only, mean of 20) beside PyTorch's convolution_backward"
echo "(cuDNN, channels_last, cudnn.benchmark; mean of 20) on the same layers (bench/conv_gradients.py):"
if have_time 60 "the convolution gradients benchmark"; then
  python3 bench/conv_gradients.py --graphs "$log/conv_gradients" 2>/dev/null
  for graph in "$log"/conv_gradients/*.json; do
    "$kit/bin/bench_megakernel" --modes kernels --runs 20 "$graph" 2>&1 | sed -n 2p
  done
  python3 bench/conv_gradients.py --torch 2>&1 | tail -7
fi
echo
echo "BatchNorm in training mode (issue #40, docs/gemm.md): forward (the batch's statistics, the running ones, the output)"
echo "and backward (dx, dweight, dbias) on six ResNet-50 activations, bf16, batch 32, channels-last, as batchnorm2d_nhwc"
echo "and _backward (bench_megakernel, kernels only, mean of 20) beside PyTorch's batch_norm forward and backward"
echo "(cuDNN, channels_last; mean of 20; MiB: the least the two passes move) on the same shapes (bench/batchnorm_bench.py):"
if have_time 60 "the BatchNorm benchmark"; then
  python3 bench/batchnorm_bench.py --graphs "$log/batchnorm" 2>/dev/null
  for graph in "$log"/batchnorm/*.json; do
    "$kit/bin/bench_megakernel" --modes kernels --runs 20 "$graph" 2>&1 | sed -n 2p
  done
  python3 bench/batchnorm_bench.py --torch 2>&1 | tail -6
fi
echo
echo "Nsight Compute on three kernels of the B8 x T128 block (a pipelined matmul, attention, the MLP's down projection):"
if command -v ncu >/dev/null && have_time 90 "Nsight Compute"; then
  ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --kernel-name regex:'k9_l0_q|k12_l0_scores|k16_l0_down' --launch-count 3 \
    "$cudagen" run --gpu "$log/decoder_bf16.json" 2>&1 | grep -E '^  [a-z0-9_]+|Duration|Throughput|Achieved Occupancy|Registers' | head -60
elif ! command -v ncu >/dev/null; then
  echo "skipped: no ncu on this machine"
fi
echo
echo "megakernel (issue #13): time per step as kernels, CUDA Graph, megakernel; PyTorch on the same decoder block"
if have_time 60 "the megakernel benchmark"; then
  python3 bench/decoder_graph.py --layers 1 --tokens 64 -o "$log/decoder1.json"
  python3 bench/decoder_graph.py --layers 12 --tokens 64 -o "$log/decoder12.json"
  "$kit/bin/bench_megakernel" --runs 200 "$log/decoder1.json" "$log/decoder12.json" --step examples/train_mlp.json 2>&1
  for layers in 1 12; do python3 bench/decoder_torch.py --layers $layers --tokens 64 2>&1 | tail -2; done
fi
echo
echo "GEMM mainloops (issue #35, templates/gemm.cuh) against cuBLAS, bf16 then f32, median of 15 runs over rotating operands:"
cat "$log/gemm.txt" 2>/dev/null || echo "skipped: gemm_bench did not run"
echo
echo "The Hopper mainloop (issue #38, templates/gemm_sm90.cuh) against cuBLAS, bf16, median of 15 runs:"
cat "$log/hopper.txt" 2>/dev/null || echo "skipped: hopper_bench did not run"
failed=0
for r in "${rows[@]}"; do case "${r#*|}" in FAILED*) failed=1 ;; esac; done
exit $failed
