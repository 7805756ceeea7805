"""The generations of a prompts run, kept as they finish: each batch's records appended to ``generations.jsonl`` and
flushed to disk as the batch ends, so an interrupted run keeps every finished prompt, and ``resume=<run folder>``
goes on where it stopped. ``generations.run.json`` beside it names the prompts and settings the records belong to.

Read back, the file is validated: a torn last line (the run was killed while writing) and the lines of an unfinished
batch are dropped and generated again; a record that is not one of ours, or a folder written for other prompts or
settings, is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from offload_core.atomic import fsync_path
from offload_core.errors import ConfigError
from offload_core.plan.batches import RUN_FILE

GENERATIONS = "generations.jsonl"
#: settings whose change changes the generated tokens: a resumed run must have the same ones
SAME_SETTINGS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed", "batch_size", "dtype")


def fingerprint(settings: Any, prompts: list[str]) -> dict[str, Any]:
    """What the records of a run depend on: the prompts (a digest), the model and the generation settings
    (:data:`SAME_SETTINGS`, as the config names them)."""
    model, sampling = settings.model, settings.sampling
    digest = hashlib.sha256(json.dumps(prompts).encode("utf-8")).hexdigest()
    values = {
        "max_new_tokens": sampling.max_new_tokens,
        "do_sample": sampling.do_sample,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "batch_size": settings.batch_size,
        "dtype": settings.dtype_name,
    }
    return {
        "prompts_sha256": digest,
        "prompts": len(prompts),
        "model": {key: model.get(key) for key in ("name", "path", "preset", "chat_template")},
        **{key: values[key] for key in SAME_SETTINGS},
    }


def _is_record(record: Any, prompt: str) -> bool:
    return (
        isinstance(record, dict)
        and record.get("prompt") == prompt
        and isinstance(record.get("text"), str)
        and isinstance(record.get("token_ids"), list)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in record["token_ids"])
    )


@dataclass
class Journal:
    """``generations.jsonl`` of a run folder, opened for appending after the records already there (``done``)."""

    folder: Path
    prompts: list[str]
    done: list[dict[str, Any]] = field(default_factory=list)
    handle: BinaryIO | None = None

    @property
    def path(self) -> Path:
        return self.folder / GENERATIONS

    @classmethod
    def open(cls, folder: Path, prompts: list[str], batch_size: int, run: dict[str, Any], resume: bool) -> "Journal":
        """Start ``folder``'s journal, or (``resume``) read and check the one there and go on after its last whole
        batch."""
        folder.mkdir(parents=True, exist_ok=True)
        journal = cls(folder, prompts)
        if resume:
            journal.done = journal._read(run, batch_size)
        elif journal.path.exists() and journal.path.stat().st_size:
            raise ConfigError(
                f"{journal.path} already holds generations; go on with resume={folder}, or give another "
                "run folder (hydra.run.dir=...)"
            )
        else:
            meta = folder / RUN_FILE
            meta.write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
            fsync_path(meta)
        journal.handle = open(journal.path, "ab" if resume else "wb")
        return journal

    def _read(self, run: dict[str, Any], batch_size: int) -> list[dict[str, Any]]:
        where = f"resume={self.folder}"
        try:
            saved = json.loads((self.folder / RUN_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(
                f"{where}: the folder holds no {RUN_FILE}, so it is not a prompts run's folder; give the "
                "folder of the run to go on with"
            ) from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where}: {RUN_FILE} cannot be read ({exc}); start a new run without resume") from None
        if saved != run:
            changed = sorted(
                k for k in set(saved) | set(run) if not isinstance(saved, dict) or saved.get(k) != run.get(k)
            )
            raise ConfigError(
                f"{where}: that run was made with other {', '.join(changed)}; resume it with the same "
                "prompts file and settings, or start a new run without resume"
            )
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = b""
        lines = raw.split(b"\n")
        records = []
        for number, line in enumerate(lines[:-1], 1):  # the last piece has no newline: torn, or empty
            try:
                record = json.loads(line.decode("utf-8"))
            except ValueError:
                record = None
            if number > len(self.prompts) or not _is_record(record, self.prompts[number - 1]):
                if number == len(lines) - 1:
                    break  # a last line cut short by the kill: generated again
                raise ConfigError(
                    f"{where}: line {number} of {GENERATIONS} is not a generation of prompt {number}; "
                    "start a new run without resume"
                )
            records.append(record)
        whole = len(records) - len(records) % batch_size if len(records) < len(self.prompts) else len(records)
        keep = sum(len(lines[i]) + 1 for i in range(whole))
        if keep != len(raw):
            with open(self.path, "r+b") as f:  # drop the torn line and the unfinished batch: they are generated again
                f.truncate(keep)
            fsync_path(self.path)
        return records[:whole]

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append ``records`` (one batch) and flush them to disk before the next batch starts."""
        assert self.handle is not None
        self.handle.write(b"".join(json.dumps(r).encode("utf-8") + b"\n" for r in records))
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the file with ``records`` at once (the finished run's, with what only the end knows)."""
        from offload_core.atomic import atomic_write

        self.close()
        with atomic_write(self.path) as tmp:
            tmp.write_bytes(b"".join(json.dumps(r).encode("utf-8") + b"\n" for r in records))
