"""What a job reads from outside, checked before anything starts: its data globs, its
tokenizer and a pretrained model's config.json (diloco/hf.py). `diloco run` checks them on the
machine it runs on; `diloco validate --inputs` does the same for a manifest you will run here.

A cluster manifest's paths are the pods' (a mounted volume, a bucket the pods' identity can
read), so plain `validate` checks the manifest as the operator does, which reads none of them.
Here only fsspec's listing and existence calls: nothing is downloaded. Once every input is
there, both read the data itself as the learner will (a little of every file, with the learner's
readers: trainer/data/probe.py), which needs the learner extra's readers (pyarrow, zstandard,
tokenizers); a base install names that extra (`missing_reader`) instead.
"""

from __future__ import annotations

from diloco import extras, hf
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


def reads_data(job: DecoupledDiLoCoJob) -> bool:
    """Whether the job reads files of data or a tokenizer (the builtin corpus as bytes reads none)."""
    return any(job.spec.data_for(g.name).source.kind != "builtin" for g in job.spec.learner_groups) or \
        job.spec.data.source.encoding != "bytes"


def missing_reader(field: str, module: str) -> str:
    """The line for a reader this install lacks (the base install has no pyarrow, zstandard or
    tokenizers: the syncer image's `diloco validate --inputs`)."""
    return (f"{field}: reading the data as the learner will needs {module}, which this install lacks; install the "
            f"learner extra: pip install '{extras.DISTRIBUTION}[{extras.LEARNER}]'")
