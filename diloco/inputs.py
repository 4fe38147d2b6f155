"""What a job reads from outside, checked before anything starts: its data globs, its
tokenizer and a pretrained model's config.json (diloco/hf.py). `diloco run` checks them on the
machine it runs on; `diloco validate --inputs` does the same for a manifest you will run here.

A cluster manifest's paths are the pods' (a mounted volume, a bucket the pods' identity can
read), so plain `validate` checks the manifest as the operator does, which reads none of them.
Only fsspec's listing and existence calls: nothing is downloaded.
"""

from __future__ import annotations

from diloco import hf
from diloco.spec import DecoupledDiLoCoJob, SpecError

# gcsfs and s3fs: the learner image has them; a local install names the extra.
CLOUD_FIX = "gs:// and s3:// need the cloud extra: pip install 'decoupled-diloco[learner,cloud]'"


def problems(job: DecoupledDiLoCoJob) -> list[str]:
    """One `field: problem; fix` line per input that is not there (empty: all present)."""
    from diloco import copy_listings
    from diloco.spec import path_field

    spec = job.spec
    src, out = spec.data.source, []
    seen: set[tuple[str | None, str | None]] = set()
    for i, g in enumerate(spec.learner_groups):  # every group's copy (spec/copy_listings.py), each once
        ours = spec.data_for(g.name).source
        if (key := (ours.path, ours.held_out_path)) in seen:
            continue
        seen.add(key)
        for held, pattern in ((False, ours.path), (True, ours.held_out_path)):
            if pattern is not None and (problem := _unmatched(pattern)) is not None:
                field = path_field(spec.data, g, i, held_out=held)
                if f"{field}: {problem}" not in out:
                    out.append(f"{field}: {problem}")
    if not out:  # every copy there: each must hold the same files and sizes
        out += copy_listings.copy_problems(spec)
    if src.encoding != "bytes":
        try:
            found = hf.exists(src.encoding)
        except (OSError, ImportError, ValueError) as exc:
            out.append(f"spec.data.source.tokenizer: cannot look up {src.encoding!r} ({exc})")
        else:
            if not found:
                out.append(f"spec.data.source.tokenizer: no file at {src.encoding!r}; give the path of a Hugging Face "
                           "tokenizer.json, or \"bytes\" for byte-level ids")
    return out


def _unmatched(pattern: str) -> str | None:
    from fsspec.core import url_to_fs

    try:
        fs, stripped = url_to_fs(pattern)
        found = fs.glob(stripped, detail=True)
    except ImportError as exc:  # gs:// without gcsfs, s3:// without s3fs
        return f"cannot read {pattern!r}: {exc} ({CLOUD_FIX})"
    except (OSError, ValueError) as exc:
        return f"cannot list {pattern!r} ({exc}); check the path and your access to it"
    if not any(info.get("type") == "file" for info in found.values()):
        return (f"no files match {pattern!r} (relative paths are from where you run diloco); check the path, "
                "or prepare the data first (docs/DATA.md)")
    return None


def check(job: DecoupledDiLoCoJob) -> DecoupledDiLoCoJob:
    """The job with its pretrained model resolved, or SpecError naming every input missing."""
    job = hf.resolve(job)
    missing = problems(job)
    if missing:
        raise SpecError(missing)
    return job
