"""Named mutations of the package: does the test suite notice each bug?

Every mutation is one realistic bug written as an exact text replacement in one source file. The
script copies the project as it is now (tracked and untracked files, no caches) into
`.cache/mutation/`, runs the targeted tests on the unmutated copy first (they must pass), then, for
each mutation, applies it to a fresh copy and runs the same tests with that copy first on
PYTHONPATH. A mutation is *killed* when a test fails, *survived* when all pass. An anchor that is
no longer in the source (the code changed) is reported as `stale anchor`, never as a pass.

    .venv/bin/python tests/mutation/run_mutations.py            # every mutation
    .venv/bin/python tests/mutation/run_mutations.py --list     # names and the bug each stands for
    .venv/bin/python tests/mutation/run_mutations.py --only pn-eval-without-eps --only post-norm-order

Exit status 0 when every mutation is killed (or survives with a reason written in `Mutation.reason`),
1 otherwise. The last result and the reasons for survivors are in TESTING.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".cache" / "mutation"
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", ".cache", "__pycache__", "*.egg-info", ".pytest_cache",
                                     "outputs", "runs", "build", "dist")
NORMALIZATION = "hf_powernorm/normalization.py"
DISPATCH = "hf_powernorm/norm_dispatch.py"
FUNCTIONAL = "hf_powernorm/norm_functional.py"
MODELING = "hf_powernorm/modeling_powernorm.py"
NORM_TESTS = ("tests/norms/test_normalization.py",)
MODEL_TESTS = ("tests/models/test_modeling_powernorm.py",)


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the project root
    anchor: str  # exact source text; must occur exactly once
    replacement: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids
    bug: str  # the bug it stands for
    reason: str = ""  # why surviving is acceptable, when it is


NORMALIZATION_MUTATIONS = [
    Mutation(
        "pn-eval-without-eps", NORMALIZATION,
        '        """The eval-mode map `y = GS(x) * scale + shift` as float32 `(scale, shift)`."""\n'
        "        scale = self.weight.float() * torch.rsqrt(self.running_phi + self.eps)\n",
        '        """The eval-mode map `y = GS(x) * scale + shift` as float32 `(scale, shift)`."""\n'
        "        scale = self.weight.float() * torch.rsqrt(self.running_phi)\n",
        NORM_TESTS, "PN's eval forward divides by sqrt(phi) instead of sqrt(phi + eps)"),
    Mutation(
        "pn-switch-before-warmup-ends", FUNCTIONAL,
        "    weight = ((step - warmup) / (ramp + 1)).clamp(0.0, 1.0).to(v.dtype)\n",
        "    weight = ((step - warmup + 1) / (ramp + 1)).clamp(0.0, 1.0).to(v.dtype)\n",
        NORM_TESTS, "PN's forward uses the running statistic from t = W (t < W) instead of t > W (t <= W)"),
    Mutation(
        "pn-nu-update-sign", NORMALIZATION,
        "            updated = self.running_nu * (1.0 - rate * gamma.float()) + rate * lam.float()\n",
        "            updated = self.running_nu * (1.0 - rate * gamma.float()) - rate * lam.float()\n",
        NORM_TESTS, "the running gradient statistic nu subtracts Lambda (eq. 13 sign)"),
    Mutation(
        "pn-warmup-phi-not-cumulative", FUNCTIONAL,
        "        updated = torch.lerp(phi, v, torch.where(step <= warmup, cumulative_rate, ema_rate))\n",
        "        updated = torch.lerp(phi, v, ema_rate)\n",
        NORM_TESTS, "during warmup running_phi is an EMA instead of the cumulative mean"),
    Mutation(
        "pn-backward-denominator-always-batch", FUNCTIONAL,
        '    inv_s_b = inv_s if backward == "running" else batch\n',
        "    inv_s_b = batch\n",
        NORM_TESTS, 'backward_denominator="running" divides the backward by the batch statistic'),
    Mutation(
        "pn-nu-correction-on-padding", FUNCTIONAL,
        "    correction = z0 * c if token_weights is None else z0 * c * token_weights[:, None]\n",
        "    correction = z0 * c\n",
        NORM_TESTS, "the -nu*Z correction of the backward reaches padded positions (eager path)"),
    Mutation(
        "pn-counter-not-incremented", NORMALIZATION,
        "            self.running_phi.copy_(next_phi)\n            self._count_batch_(usable)\n",
        "            self.running_phi.copy_(next_phi)\n",
        NORM_TESTS + MODEL_TESTS, "PN's num_batches_tracked never increments, so warmup never ends"),
    Mutation(
        "pn-recomputation-updates-again", DISPATCH,
        "        if in_recomputation():\n            record = norm.last_step\n"
        "            y = _pn_output_pass(x, weight, bias, record.stats[1], norm.group_num, norm.group_eps)\n",
        "        if False:\n            record = norm.last_step\n"
        "            y = _pn_output_pass(x, weight, bias, record.stats[1], norm.group_num, norm.group_eps)\n",
        NORM_TESTS + MODEL_TESTS, "activation checkpointing's recomputed forward updates PN's buffers twice"),
    Mutation(
        "padding-counted-in-statistics", DISPATCH,
        "    real = attention_mask.reshape(-1).to(flat.device) != 0\n",
        "    real = attention_mask.reshape(-1).to(flat.device) != 2\n",
        NORM_TESTS + MODEL_TESTS, "every norm treats padded tokens as real in its batch statistics"),
    Mutation(
        "pn-buffers-updated-in-eval", DISPATCH,
        "    scale, shift = norm.affine_after_group_scale()\n",
        "    scale, shift = norm.affine_after_group_scale()\n"
        "    norm.running_phi.lerp_(flat.detach().float().square().mean(0), 0.1)\n"
        "    norm.num_batches_tracked.add_(1)\n",
        NORM_TESTS + MODEL_TESTS, "PN's eval forward updates running_phi and the counter (output unchanged)"),
    Mutation(
        "pn-group-scaling-off-in-eval", DISPATCH,
        "        z0 = group_scale(flat, norm.group_num, norm.group_eps).to(dtype)\n"
        "        out = torch.addcmul(shift.to(dtype), z0, scale.to(dtype)).to(flat.dtype)\n",
        "        z0 = flat.to(dtype)\n"
        "        out = torch.addcmul(shift.to(dtype), z0, scale.to(dtype)).to(flat.dtype)\n",
        NORM_TESTS, "PN's eval forward skips group scaling (training keeps it)"),
    Mutation(
        "pn-v-eval-without-eps", DISPATCH,
        "    return torch.addcmul(norm.bias.to(dtype), z0 * torch.rsqrt(phi + norm.eps), norm.weight.to(dtype))\n",
        "    return torch.addcmul(norm.bias.to(dtype), z0 * torch.rsqrt(phi + norm.eps * norm.training), "
        "norm.weight.to(dtype))\n",
        NORM_TESTS, "PN-V's eval forward divides by sqrt(phi) instead of sqrt(phi + eps)"),
    Mutation(
        "bn-running-variance-biased", NORMALIZATION,
        "            unbiased = var.detach().float() * (n / (n - 1.0).clamp_min(1.0))\n",
        "            unbiased = var.detach().float()\n",
        NORM_TESTS, "BN's running variance takes the biased batch variance"),
    Mutation(
        "non-finite-batch-updates-buffers", FUNCTIONAL,
        "    finite = torch.isfinite(statistics[0]).all()\n",
        "    finite = torch.ones((), dtype=torch.bool, device=statistics[0].device)\n",
        NORM_TESTS, "a NaN/inf batch statistic is written into the running buffers"),
    Mutation(
        "bf16-buffers-on-cast", NORMALIZATION,
        "            if new is not None and new.dtype != torch.float32:\n",
        "            if False:\n",
        NORM_TESTS + MODEL_TESTS, "model.to(torch.bfloat16) casts the running statistics to bfloat16"),
]

MODELING_MUTATIONS = [
    Mutation(
        "post-norm-order", MODELING,
        "        hidden_states = residual + apply_dropout(hidden_states, self.dropout, self.training)\n"
        "        if not self.normalize_before:\n"
        "            hidden_states = norm(hidden_states, padding_mask)\n",
        "        if not self.normalize_before:\n"
        "            hidden_states = norm(hidden_states, padding_mask)\n"
        "        hidden_states = residual + apply_dropout(hidden_states, self.dropout, self.training)\n",
        MODEL_TESTS, "a post-norm layer normalizes the sub-layer output before the residual add"),
    Mutation(
        "encoder-attention-ignores-mask", MODELING,
        "            hidden_states, weights = layer(hidden_states, attn_mask, attention_mask, "
        "**_attention_kwargs(kwargs))\n",
        "            hidden_states, weights = layer(hidden_states, None, attention_mask, "
        "**_attention_kwargs(kwargs))\n",
        MODEL_TESTS, "the encoder's self-attention attends to padded positions"),
    Mutation(
        "cross-attention-ignores-mask", MODELING,
        "            return self.encoder_attn(states, attention_mask=encoder_attention_mask,\n",
        "            return self.encoder_attn(states, attention_mask=None,\n",
        MODEL_TESTS, "the decoder's cross-attention attends to padded source positions"),
    Mutation(
        "eager-attention-ignores-mask", MODELING,
        "        attn_weights = attn_weights + attention_mask\n",
        "        attn_weights = attn_weights\n",
        MODEL_TESTS, "the eager attention drops the mask (sdpa keeps it)"),
    Mutation(
        "decoder-norms-see-padding", MODELING,
        "        padding_mask = attention_mask[:, -seq_length:] if attention_mask is not None else None\n",
        "        padding_mask = None\n",
        MODEL_TESTS, "the decoder's norms take batch statistics over padded positions"),
    Mutation(
        "ignored-labels-not-padding", MODELING,
        "                decoder_attention_mask = (labels != -100).long()\n",
        "                decoder_attention_mask = None\n",
        MODEL_TESTS, "decoder positions fed from -100 labels enter the decoder's batch statistics"),
    Mutation(
        "positions-count-padding", MODELING,
        "    positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)\n",
        "    positions = torch.arange(attention_mask.shape[-1], device=device).expand(batch_size, -1)\n",
        MODEL_TESTS, "left padding shifts the positions of the real tokens"),
    Mutation(
        "tied-embeddings-broken", MODELING,
        '    _tied_weights_keys = {"lm_head.weight": "model.encoder.embeddings.embed_tokens.weight"}\n',
        "    _tied_weights_keys = {}\n",
        MODEL_TESTS, "the translation model's output projection is not tied to the embeddings"),
    Mutation(
        "bf16-buffers-on-load", MODELING,
        "    _keep_in_fp32_modules_strict = _Float32Buffers()\n",
        "    _keep_in_fp32_modules_strict = []\n",
        MODEL_TESTS, "from_pretrained(dtype=torch.bfloat16) rounds the running statistics to bfloat16",
        reason="equivalent under transformers 5.23 and 5.24: without the list the loaded statistics stay float32 and "
               "bit-identical (the norms create them float32 and keep them so when the model is cast); "
               "the list guards loaders that cast buffers, and bf16-buffers-on-cast is killed"),
    Mutation(
        "init-weights-skips-norms", MODELING,
        "            self._init_norm(module)\n",
        "            pass\n",
        MODEL_TESTS, "_init_weights leaves norms (and buffers missing from a checkpoint) uninitialised"),
    Mutation(
        "missing-buffers-not-reported", MODELING,
        "        if missing:\n",
        "        if False:\n",
        MODEL_TESTS, "loading a checkpoint without running statistics says nothing"),
    Mutation(
        "fold-norms-drops-shift", MODELING,
        "        linear.bias.copy_((linear.bias.float() + weight @ shift).to(linear.bias.dtype))\n",
        "        linear.bias.copy_(linear.bias.float().to(linear.bias.dtype))\n",
        MODEL_TESTS, "fold_norms drops the norm's shift (bias, BN mean) from the folded linear"),
]

# Mutations of the training library's loss and learning-rate schedule (`hf_powernorm/training/`,
# targets: the training and recipe tests) go here, in the same form.
LOSSES = "hf_powernorm/training/losses.py"
OPTIMIZATION = "hf_powernorm/training/optimization.py"
TOKENIZATION = "hf_powernorm/training/tokenization.py"
BATCHING = "hf_powernorm/training/batching.py"
CHECKPOINTS = "hf_powernorm/training/checkpoints.py"
RESUMING = "hf_powernorm/training/resuming.py"
LOOP = "hf_powernorm/training/loop.py"
LANGUAGE_MODELING = "hf_powernorm/training/language_modeling.py"
LOCKING = "hf_powernorm/training/locking.py"
PLAN = "hf_powernorm/compare/plan.py"
LM_DATA_TESTS = "tests/training/test_lm_data.py"
TRAINING_TESTS = ("tests/training/test_training_loop.py",)
DATA_TESTS = ("tests/training/test_training_data.py",)

TRAINING_MUTATIONS: list[Mutation] = [
    Mutation(
        "label-smoothing-ignored", LOSSES,
        "                                       float(label_smoothing))\n",
        "                                       0.0)\n",
        TRAINING_TESTS, "the translation loss ignores --label_smoothing"),
    Mutation(
        "inverse-sqrt-decays-linearly", OPTIMIZATION,
        "        return math.sqrt(warmup_steps / step)\n",
        "        return warmup_steps / step\n",
        TRAINING_TESTS, "fairseq's inverse-sqrt schedule decays as 1/step"),
    Mutation(
        "lm-blocks-without-overlap", TOKENIZATION,
        "    stride = block_size - 1\n",
        "    stride = block_size\n",
        DATA_TESTS, "consecutive LM blocks do not overlap: one token in every block is never a target"),
    Mutation(
        "lm-blocks-drop-the-carried-token", TOKENIZATION,
        "            stream = _token_before(part, indices[0])\n",
        "            stream = []\n",
        DATA_TESTS, "the first token of each map batch of lines is never a target"),
    Mutation(
        "decoder-mask-marks-padding-real", BATCHING,
        '                batch["decoder_attention_mask"] = (batch["labels"] != IGNORE_INDEX).long()\n',
        '                batch["decoder_attention_mask"] = torch.ones_like(batch["labels"])\n',
        DATA_TESTS, "the collator's decoder mask counts padded target positions as real"),
    Mutation(
        "statistics-summed-not-averaged", CHECKPOINTS,
        "                buffer.copy_(total / accelerator.num_processes)\n",
        "                buffer.copy_(total)\n",
        ("tests/training/test_recipes_lm_cls.py::test_statistics_are_averaged_across_processes",),
        "the processes' running statistics are summed instead of averaged before a save"),
    Mutation(
        "early-stopping-comparison-flipped", LOOP,
        '        better = self.best is None or (value < self.best if self.mode == "min" else value > self.best)\n',
        '        better = self.best is None or (value > self.best if self.mode == "min" else value < self.best)\n',
        ("tests/training/test_recipes_lm_cls.py::test_early_stopping_state_round_trips",),
        "early stopping keeps the worst validation as the best"),
    Mutation(
        "resume-restarts-the-epoch", RESUMING,
        "    return completed, batches // batches_per_epoch, batches % batches_per_epoch, state\n",
        "    return completed, batches // batches_per_epoch, 0, state\n",
        ("tests/training/test_recipes_lm_cls.py::test_lm_resume_from_latest_matches_an_unbroken_run",),
        "a resumed run starts its epoch from the first batch again instead of where it stopped"),
    Mutation(
        "task-ignores-no-keep-linebreaks", LANGUAGE_MODELING,
        "                               keep_linebreaks=args.keep_linebreaks, **options)\n",
        "                               keep_linebreaks=True, **options)\n",
        (f"{LM_DATA_TESTS}::test_no_keep_linebreaks_joins_the_lines_across_blank_lines",),
        "the language-modelling task's tokenize keeps line breaks under --no_keep_linebreaks"),
    Mutation(
        "line-end-without-eos-is-none", TOKENIZATION,
        "    return () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)\n",
        "    return (tokenizer.eos_token_id,)\n",
        (f"{LM_DATA_TESTS}::test_a_tokenizer_without_an_end_token_puts_only_text_in_the_stream",),
        "a tokenizer without EOS ends every line of a text file with a None id"),
    Mutation(
        "fingerprint-reads-the-train-file-only", PLAN,
        "    data = [Path(getattr(options, k)) for k in task_class(options).input_path_options "
        "if getattr(options, k, None)]\n",
        "    data = [Path(getattr(options, k)) for k in task_class(options).input_path_options[:1] "
        "if getattr(options, k, None)]\n",
        ("tests/compare/test_compare_options.py::test_each_data_file_is_in_the_fingerprint",),
        "compare's fingerprint hashes the train file only: an edited validation or test file reuses the runs"),
    Mutation(
        "lock-without-flock-takes-a-live-holders", LOCKING,
        '        return not (holder and (holder.get("host") != socket.gethostname() '
        'or _pid_alive(holder.get("pid"))))\n',
        "        return True\n",
        ("tests/training/test_training_locking.py::test_without_flock_the_holders_pid_decides",),
        "without flock, the lock of a live holder (here or on another host) is taken over"),
]

MUTATIONS = NORMALIZATION_MUTATIONS + MODELING_MUTATIONS + TRAINING_MUTATIONS


def _pytest_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    for name, sub in (("HF_HOME", ".cache/hf"), ("TMPDIR", ".cache/tmp"), ("HF_POWERNORM_CACHE", ".cache/kernels")):
        env.setdefault(name, str(ROOT / sub))
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.setdefault(name, "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run_tests(copy: Path, tests: tuple[str, ...], timeout: int) -> tuple[str, str, float]:
    """Status (`passed`, `failed`, `error` for collection or internal errors, `no tests`, `timeout`),
    the first failing test, and seconds."""
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider", *tests]
    start = time.perf_counter()
    try:
        completed = subprocess.run(command, cwd=copy, env=_pytest_env(copy), capture_output=True, text=True,
                                   timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", time.perf_counter() - start
    status = {0: "passed", 1: "failed", 5: "no tests"}.get(completed.returncode, "error")
    if status == "error":
        print(completed.stdout[-2000:] + completed.stderr[-2000:], file=sys.stderr)
    failing = next((line.split()[1] for line in completed.stdout.splitlines()
                    if line.startswith(("FAILED ", "ERROR "))), "")
    return status, failing, time.perf_counter() - start


def _check_package_comes_from(copy: Path) -> None:
    code = "import hf_powernorm; print(hf_powernorm.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=_pytest_env(copy), capture_output=True,
                         text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the tests would import hf_powernorm from {out}, not from the copy {copy}")


def _anchor_count(mutation: Mutation, copy: Path) -> int:
    return (copy / mutation.path).read_text().count(mutation.anchor)


def _apply(mutation: Mutation, copy: Path) -> None:
    path = copy / mutation.path
    path.write_text(path.read_text().replace(mutation.anchor, mutation.replacement))


def _outcome(status: str) -> str:
    return {"failed": "killed", "timeout": "killed (timeout)", "passed": "survived"}.get(status, status)


def run(mutations: list[Mutation], timeout: int) -> int:
    WORK.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=WORK))
    try:
        snapshot = run_dir / "snapshot"
        shutil.copytree(ROOT, snapshot, ignore=COPY_IGNORE)
        _check_package_comes_from(snapshot)
        stale = [m for m in mutations if _anchor_count(m, snapshot) != 1]
        for mutation in stale:
            print(f"{mutation.name}: its anchor is in {mutation.path} {_anchor_count(mutation, snapshot)} times, "
                  "not once: the code changed, update the mutation", file=sys.stderr)
        runnable = [m for m in mutations if m not in stale]
        targets = tuple(dict.fromkeys(t for m in runnable for t in m.tests))
        if targets:
            status, failing, seconds = _run_tests(snapshot, targets, timeout)
            print(f"baseline (unmutated copy): {status} in {seconds:.0f} s {failing}", flush=True)
            if status != "passed":
                print("the targeted tests fail without any mutation: no result", file=sys.stderr)
                return 1
        rows = [(m, "stale anchor", "", 0.0) for m in stale]
        for mutation in runnable:
            copy = run_dir / mutation.name
            shutil.copytree(snapshot, copy)
            _apply(mutation, copy)
            status, failing, seconds = _run_tests(copy, mutation.tests, timeout)
            rows.append((mutation, _outcome(status), failing, seconds))
            print(f"{mutation.name}: {_outcome(status)} ({seconds:.0f} s) {failing}", flush=True)
            shutil.rmtree(copy, ignore_errors=True)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    _print_table(rows)
    accepted = [m for m, outcome, _, _ in rows
                if outcome.startswith("killed") or (outcome == "survived" and m.reason)]
    return 0 if len(accepted) == len(rows) else 1


def _print_table(rows) -> None:
    print("\n| mutation | bug | result | first failing test |\n| --- | --- | --- | --- |")
    for mutation, outcome, failing, _ in rows:
        note = f": {mutation.reason}" if outcome == "survived" and mutation.reason else ""
        test = f"`{failing.split('/')[-1]}`" if failing else ""
        print(f"| `{mutation.name}` | {mutation.bug} | {outcome}{note} | {test} |")
    killed = sum(outcome.startswith("killed") for _, outcome, _, _ in rows)
    print(f"\n{killed} of {len(rows)} mutations killed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run this mutation (repeatable)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for one test run (default 900)")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTATIONS}
    if args.list:
        for mutation in MUTATIONS:
            print(f"{mutation.name:40} {mutation.path:38} {mutation.bug}")
        return 0
    unknown = sorted(set(args.only or ()) - set(by_name))
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; --list shows them")
    selected = [by_name[name] for name in args.only] if args.only else MUTATIONS
    return run(selected, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
