#!/usr/bin/env bash
# tinker-cookbook's recipes, unmodified, against `artrl server` on this machine (docs/tinker.md quotes what
# this printed). What changes: the base URL, the key, the model name (the cookbook maps a hub id to its
# renderer: here a folder named Qwen/Qwen3-8B holding the tiny model, relative to the working folder), and the
# hub datasets (no hub here: local folders of the same names stand in, as `datasets.load_dataset` reads a
# local folder first). The cookbook and its pure-Python dependencies go into WORK, not into .venv.
#
#   bash scripts/cookbook_check.sh [WORK]      (default /tmp/artrl-cookbook; about 2 minutes)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
py="$repo/.venv/bin/python"
work="${1:-/tmp/artrl-cookbook}"
mkdir -p "$work" && cd "$work"

if [ ! -d src/tinker_cookbook ]; then
  "$py" -m pip download -q tinker-cookbook==0.6.1 --no-deps -d dl 2>>pip.log
  "$py" -m zipfile -e dl/tinker_cookbook-0.6.1-py3-none-any.whl src
fi
if [ ! -d deps/chz ]; then
  "$py" -m pip install -q --target deps --no-deps aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 \
    antlr4-python3-runtime==4.13.2 blobfile==3.3.0 chz==0.4.0 cloudpickle==3.1.3 frozenlist==1.8.0 lxml==6.2.0 \
    math-verify==0.9.0 multidict==7.2.1 propcache==0.5.4 pycryptodomex==3.24.2 pylatexenc==2.11 pyrage==1.4.0 \
    termcolor==3.3.0 tml-renderers==0.2.1 yarl==1.25.1 2>>pip.log
fi

# the model, under the hub id the cookbook knows (renderer qwen3: the tiny tokenizer has <|im_start|>, <|im_end|>)
[ -d tiny ] || "$py" -c "import artrl; artrl.build_tiny_model('tiny')"
mkdir -p Qwen && ln -sfn ../tiny Qwen/Qwen3-8B
# the datasets: HuggingFaceH4/no_robots from the cookbook's own example conversations, openai/gsm8k as sums
mkdir -p HuggingFaceH4/no_robots/data openai/gsm8k/main
cp src/tinker_cookbook/example_data/conversations.jsonl HuggingFaceH4/no_robots/data/train.jsonl
head -16 src/tinker_cookbook/example_data/conversations.jsonl > HuggingFaceH4/no_robots/data/test.jsonl
"$py" - <<'PY'
import json, random
rng = random.Random(0)
for split, n in (("train", 64), ("test", 16)):
    with open(f"openai/gsm8k/main/{split}.jsonl", "w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            q = f"Tom has {a} apples and buys {b} more. How many apples does he have?"
            f.write(json.dumps({"question": q, "answer": f"Tom has {a} + {b} = <<{a}+{b}={a+b}>>{a+b} apples.\n#### {a+b}"}) + "\n")
PY
printf -- '---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n  - split: test\n    path: main/test.jsonl\n---\n' > openai/gsm8k/README.md

key=tml-cookbook-0123456789abcdef
echo "cook $key" > keys
port=$("$py" -c "from artrl.local.engine.vllm.server import free_port; print(free_port())")
rm -rf runs logs
"$repo/.venv/bin/artrl" server Qwen/Qwen3-8B --port "$port" --path runs --keys keys > server.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done

export PYTHONPATH="$work/src:$work/deps" TINKER_API_KEY=$key TINKER_TELEMETRY=0 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
common=(base_url="http://127.0.0.1:$port" model_name=Qwen/Qwen3-8B lora_rank=8)
run() {  # NAME ARGS...: a recipe, its output in NAME.out, its tail shown
  local name=$1; shift
  echo "== $name: python -m tinker_cookbook.recipes.$name $*"
  "$py" -m "tinker_cookbook.recipes.$name" "$@" > "$name.out" 2>&1 && echo "exit 0" || echo "exit $?"
  grep -aE "train_mean_nll|reward/total|env/all/reward/total|Saved checkpoints|completed" "$name.out" | tail -6
}
run sl_loop "${common[@]}" batch_size=4 max_steps=3 log_path="$work/logs/sl_loop"
run rl_basic "${common[@]}" dataset_builder=tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder \
  dataset_builder.batch_size=4 dataset_builder.group_size=4 dataset_builder.model_name_for_tokenizer=Qwen/Qwen3-8B \
  dataset_builder.renderer_name=qwen3 max_tokens=32 max_steps=2 log_path="$work/logs/rl_basic"
run rl_loop "${common[@]}" batch_size=4 group_size=4 max_tokens=32 max_steps=2 loss_fn=importance_sampling \
  log_path="$work/logs/rl_loop"
