"""A saved step as a Hugging Face folder: `artrl export` (the checkpoint as it is: a PEFT adapter folder that
references its base, or a full model) and `artrl merge` (LoRA merged into the base: a full model usable as
`base_model=` and by vLLM). Both add the tokenizer and appear at OUT in one rename."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from artrl.local.runs.run_folder import TRAINING_FILES, Run, RunError
from artrl.storage import prepare_output, publish_directory


def export_step(run: Run, out: str | Path, step: int | None = None) -> tuple[int, Path]:
    """Copy checkpoint `step` (the latest when None) without its training state, plus the tokenizer."""
    step, checkpoint = run.checkpoint(step)

    def write(tmp: Path) -> None:
        for file in checkpoint.iterdir():
            if file.is_file() and file.name not in TRAINING_FILES:
                shutil.copy2(file, tmp / file.name)
        save_tokenizer(run, tmp)

    return step, _publish(out, write)


def merge_step(run: Run, out: str | Path, step: int | None = None) -> tuple[int, Path]:
    """Base model + the LoRA of checkpoint `step`, merged (`merge_and_unload`) and saved with the tokenizer;
    the base's dtype is kept."""
    if not run.is_lora:
        raise RunError(
            f"{run.directory} fine-tunes every weight (lora=None): its checkpoints are full models already, "
            "nothing to merge; use `artrl export RUN_DIR OUT` instead"
        )
    step, checkpoint = run.checkpoint(step)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    try:
        base = AutoModelForCausalLM.from_pretrained(run.base_model, dtype="auto", **run.hub_options)
    except OSError as exc:
        raise RunError(
            f"could not load the run's base model {run.base_model!r} ({' '.join(str(exc).split())[:300]}); "
            "merging needs it on this machine (a folder, or a hub id in the local cache)"
        ) from None

    def write(tmp: Path) -> None:
        merged = PeftModel.from_pretrained(base, str(checkpoint)).merge_and_unload()
        merged.save_pretrained(str(tmp))
        save_tokenizer(run, tmp)

    return step, _publish(out, write)


def save_tokenizer(run: Run, folder: Path) -> None:
    """The run's saved tokenizer copy into `folder` (the base model's tokenizer for an older run)."""
    saved = run.directory / "tokenizer"
    if saved.is_dir():
        shutil.copytree(saved, folder, dirs_exist_ok=True)
        return
    from artrl.local.models.loading import load_tokenizer

    load_tokenizer(run.base_model, **run.hub_options).save_pretrained(str(folder))


def _publish(out: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a temporary sibling folder of `out`, which then becomes `out` in one rename."""
    final = prepare_output(out)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        publish_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
