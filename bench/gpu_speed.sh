#!/usr/bin/env bash
# The decode and training-step speed check on one CUDA GPU (docs/gpu.md), from the repository root:
#
#     bash bench/gpu_speed.sh cuda OUT_DIR [BASELINE_SAMPLER_PY]
#     bash bench/gpu_speed.sh cpu OUT_DIR [BASELINE_SAMPLER_PY]   # the same parts at toy sizes, to try the script
#
# 1. the TorchSampler's GPU tests: its CUDA graphs against its eager loop, and against the trainer's log-probs;
# 2. bench_sampler.py at Qwen2.5-0.5B's shape (24 layers, vocabulary 151,936, bf16, random weights), prompts of
#    200-400 tokens, fixed length, 64 rows x 256 tokens and 512 x 128: TorchSampler, model.generate with its
#    dynamic and its static (compiled) cache, the memory roofline, and BASELINE_SAMPLER_PY's TorchSampler if given
#    (an earlier nanoagent/sampler.py, e.g. `git show REV:nanoagent/sampler.py > runs/baseline/sampler.py`);
# 3. bench_train.py --profile at the 0.5B shape with the tiny tokenizer (GRPO, 64 episodes, 5 steps, the last
#    one checkpointed), then 15 steps with a checkpoint every 5: the checkpoints' time on the step's path once
#    their pinned staging buffers exist;
# 4. bench/gpu_check.py with the time left of TOTAL_SECONDS (default 520).
# Each part has its own time limit and log in OUT_DIR, so a failure or a timeout leaves the others' numbers.
set -u
device=${1:?usage: bench/gpu_speed.sh cuda|cpu OUT_DIR [BASELINE_SAMPLER_PY]}
out=${2:?usage: bench/gpu_speed.sh cuda|cpu OUT_DIR [BASELINE_SAMPLER_PY]}
baseline=${3:-}
total=${TOTAL_SECONDS:-520}
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1  # a part killed by its time limit still leaves what it printed
mkdir -p "$out"

part() {  # part NAME SECONDS COMMAND...: run it under `timeout`, its output shown and kept in OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (at ${SECONDS}s, limit ${limit}s): $*"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local status=$?
    cat "$out/$name.log"
    echo "== $name: exit $status after ${SECONDS}s"
}

if [ "$device" = cuda ]; then
    layers=24 sizes=(--num-prompts 64 512 --max-new-tokens 256 128) lengths=(200 400) dtype=bfloat16 steps=5
    saves=(--steps 15 --save_every 5)
else
    layers=2 sizes=(--num-prompts 4 8 --max-new-tokens 8 4) lengths=(20 40) dtype=float32 steps=3
    saves=(--steps 6 --save_every 2)
fi
part sampler_tests 90 "$python" -m pytest -q -s -m gpu tests/test_gpu.py -k torch_sampler
part sampler_table 270 "$python" bench/bench_sampler.py --device "$device" --dtype "$dtype" --shape qwen0.5b \
    --layers "$layers" --vocab-size 151936 --prompt-lengths "${lengths[@]}" "${sizes[@]}" --workloads "fixed length" \
    --generate-static --repeats 2 --no-vllm ${baseline:+--baseline-sampler "$baseline"}
model_dir=$(mktemp -d)
"$python" -c "import sys; sys.path.insert(0, '.'); from nanoagent.models import save_tiny_model
save_tiny_model(sys.argv[1], hidden_size=896, num_hidden_layers=int(sys.argv[2]), num_attention_heads=14,
                num_key_value_heads=2, intermediate_size=4864)" "$model_dir/model" "$layers"
part train_profile 150 "$python" bench/bench_train.py --device "$device" --model "$model_dir/model" --warmup_steps 0 \
    --profile --steps "$steps"
part checkpoint_profile 150 "$python" bench/bench_train.py --device "$device" --model "$model_dir/model" \
    --warmup_steps 0 --profile "${saves[@]}"
part gpu_check $((total - SECONDS > 30 ? total - SECONDS : 30)) "$python" bench/gpu_check.py
