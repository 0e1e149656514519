"""Hub sources: `inspect`, `plan`, `convert` and `verify` accept a Hub repo id for SRC.

    resolve_source("zai-org/GLM-5.2-FP8", None, headers_only=True)    -> Checkpoint (no data)
    resolve_source("zai-org/GLM-5.2-FP8", "main", headers_only=False) -> Path of the snapshot

SRC is a repo id when no local folder of that name exists and it reads `org/name`.

headers_only (plan, inspect): config.json through `hf_hub_download`, and every shard's
safetensors header through `get_safetensors_metadata` (range requests for the first ~100 kB of
each shard): GLM-5.2's 700 GB are planned from a few MB of downloads.

otherwise (convert, verify): `snapshot_download` at `revision` into the standard Hub cache
($HF_HUB_CACHE, by default $HF_HOME/hub), skipping weight formats the tool never reads (*.bin,
*.pth, ...):

    $HF_HUB_CACHE/models--ORG--NAME/snapshots/SHA     (files: links into ../../blobs)

so a model already fetched with `hf download` (or by vLLM) is not downloaded again. The reader
accepts exactly those links (into the repo's own `blobs/`) and refuses any other link that
leaves the model folder. An interrupted download resumes on the next run; a finished one is
reused, also offline (HF_HUB_OFFLINE=1). The snapshot path is what the manifest records, so the
card names the base model and its exact commit.

huggingface_hub reads the token itself (HF_TOKEN or the stored login); it is never passed,
printed or logged here.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from quantize.errors import Problem, QuantizeError
from quantize.source.checkpoint import Checkpoint, checkpoint_from_headers, open_checkpoint

__all__ = [
    "http_errors",
    "hub_errors",
    "hub_source",
    "is_dataset_spec",
    "is_repo_id",
    "local_path_problem",
    "resolve_dataset",
    "resolve_source",
    "source_identity",
    "source_license",
    "split_files",
    "valid_repo_id",
]


def http_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client errors huggingface_hub can raise unwrapped: httpx2's (huggingface_hub
    2.x) or httpx's (1.x), whichever the installed one brought."""
    import importlib

    errs = []
    for mod in ("httpx2", "httpx"):
        try:
            errs.append(importlib.import_module(mod).HTTPError)
        except (ImportError, AttributeError):
            pass
    return tuple(errs)


@contextmanager
def hub_errors(shown: str, expected: str, not_found: str = "check the repo id and --revision"):
    """Hub failures -> a QuantizeError naming `shown` (repo[@revision]) and the fix: offline with
    nothing cached, HTTP 401 / 403 / 404, a broken download."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        yield
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        from huggingface_hub import constants

        offline = constants.HF_HUB_OFFLINE
        raise QuantizeError("the Hub cannot be reached and nothing is cached", [Problem(
            shown, None, type(e).__name__ + (" (HF_HUB_OFFLINE is set)" if offline else ""),
            "network access or a cached snapshot",
            "unset HF_HUB_OFFLINE to download it" if offline else
            "check the network (and HF_ENDPOINT), or the repo id if it was meant as a local "
            "path")]) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        fix = {401: "log in: set HF_TOKEN (read access) or run `hf auth login`",
               403: "accept the repo's terms on its Hub page, or use a token with access",
               404: not_found}.get(status, "retry; the download resumes")
        raise QuantizeError("the Hub refused the request", [Problem(
            shown, None, f"HTTP {status}: {type(e).__name__}", expected, fix)]) from None
    except (OSError, *http_errors()) as e:
        raise QuantizeError("the Hub download failed", [Problem(
            shown, None, f"{type(e).__name__}: {e}", "a finished download",
            "check the network and HF_ENDPOINT, then re-run: finished files are not fetched again")]) from None

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# Formats in source repos that the tool never reads (it reads safetensors + config + tokenizer).
_SKIP_DOWNLOAD = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.msgpack", "*.h5", "*.onnx",
                  "original/*", "*.md"]


_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<sha>[0-9a-f]{40})/?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_source(path: str) -> tuple[str | None, str | None]:
    """(repo id, commit sha) of a Hub cache snapshot path, else (None, None)."""
    m = _SNAPSHOT.search(str(path).replace("\\", "/"))
    if m is None:
        return None, None
    return f"{m['org']}/{m['name']}", m["sha"]


def _local_dir_revision(root: Path) -> str | None:
    """The commit `hf download --local-dir` fetched: the first line of the per-file metadata it
    leaves in `.cache/huggingface/download/<file>.metadata` (commit, etag, timestamp), read for
    config.json (else any file); None when absent. The metadata holds no repo id."""
    meta = root / ".cache" / "huggingface" / "download"
    for f in [meta / "config.json.metadata", *sorted(meta.glob("*.metadata"))] if meta.is_dir() else []:
        try:
            first = f.read_text(encoding="utf-8").splitlines()[0].strip()
        except (OSError, IndexError, UnicodeDecodeError):
            continue
        if _COMMIT.match(first):
            return first
    return None


def source_license(src: str | Path) -> str | None:
    """The license in the source's model card front matter (GLM releases: mit), via
    huggingface_hub's own card parser; None when there is no card or no license."""
    card = Path(src) / "README.md" if src else None
    if card is None or not card.is_file():
        return None
    try:
        from huggingface_hub import ModelCard

        lic = ModelCard.load(card).data.license
    except Exception:  # noqa: BLE001 - a card the parser refuses: no license inherited
        return None
    return lic if isinstance(lic, str) and lic else None


def source_identity(root: str | Path, base_model: str | None = None) -> dict:
    """What an output may say about where its source came from, without a local path:
    {"name", "repo_id", "revision"}. repo_id: `base_model` (convert --base-model) or the Hub
    cache snapshot's; revision: the snapshot's commit or the one `hf download --local-dir`
    recorded; name: the repo id when known, else the folder's own name."""
    root = Path(root)
    repo, rev = hub_source(str(root.resolve()) if root.exists() else str(root))
    rev = rev or (_local_dir_revision(root) if root.is_dir() else None)
    repo = base_model or repo
    return {"name": repo or root.resolve().name, "repo_id": repo, "revision": rev,
            "license": source_license(root) if root.is_dir() else None}


def valid_repo_id(s: str) -> bool:
    """`org/name` (both parts present) as huggingface_hub's own `validate_repo_id` accepts it."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(s, str) or not _REPO_ID.match(s):
        return False
    try:
        validate_repo_id(s)
    except HFValidationError:
        return False
    return True


def is_repo_id(src: str) -> bool:
    """A Hub repo id: `org/name` as huggingface_hub validates it, with no local file or folder
    of that name, not written as a path (`./x/y`, `/x/y`, `~/x`, a trailing `/`), and whose
    `org` is not a local folder (`demo/GLM-tiny-FP9` beside a `demo/` folder is a mistyped
    path, `local_path_problem` says so)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not _REPO_ID.match(src) or Path(src).exists() or src.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(src)
    except HFValidationError:
        return False
    return not Path(src.split("/", 1)[0]).is_dir()


def local_path_problem(src: str) -> QuantizeError | None:
    """For a SRC that is not a Hub repo id and does not exist: the error, naming the closest
    existing folder beside it (a typo caught before any network request)."""
    import difflib

    p = Path(src).expanduser()
    if p.exists():
        return None
    parent = p.parent if str(p.parent) else Path(".")
    near = []
    if parent.is_dir():
        near = difflib.get_close_matches(p.name, [c.name for c in parent.iterdir() if c.is_dir()], n=3)
    fix = (f"did you mean {', '.join(str(parent / n) for n in near)}?" if near else
           "pass a local checkpoint folder, or a Hub repo id org/name (no local folder named org)")
    where = f"{parent}/ exists" if parent.is_dir() and str(parent) != "." else \
        ("no such parent folder" if not parent.is_dir() else "")
    return QuantizeError("source not found", [Problem(
        src, None, "no such folder" + (f" ({where})" if where else ""),
        "a folder with config.json and *.safetensors", fix)])


def resolve_source(src: str, revision: str | None, headers_only: bool) -> Checkpoint | Path:
    """A local folder or a Hub repo id -> a header-only Checkpoint (`headers_only`) or a local
    folder holding the checkpoint (downloading it when SRC is a repo id)."""
    if not is_repo_id(src):
        if (e := local_path_problem(src)) is not None:
            raise e
        if revision is not None:
            raise QuantizeError("--revision only applies to Hub sources", [Problem(
                src, None, "a local folder", "a Hub repo id org/name", "drop --revision")])
        return open_checkpoint(src) if headers_only else Path(src)
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import NotASafetensorsRepoError

    shown = f"{src}@{revision}" if revision else src
    try:
        with hub_errors(shown, "a readable model repo"):
            if not headers_only:
                return Path(snapshot_download(src, revision=revision, ignore_patterns=_SKIP_DOWNLOAD))
            config = json.loads(Path(hf_hub_download(src, "config.json", revision=revision)).read_text())
            meta = HfApi().get_safetensors_metadata(src, revision=revision)
    except NotASafetensorsRepoError:
        raise QuantizeError("no safetensors weights in this Hub repo", [Problem(
            shown, None, "neither model.safetensors nor model.safetensors.index.json",
            "a safetensors checkpoint", "pick the repo's safetensors release (e.g. the -FP8 one)")]) from None
    headers = {
        fname: {name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
                for name, t in fm.tensors.items()}
        for fname, fm in meta.files_metadata.items()
    }
    return checkpoint_from_headers(shown, config, headers)


# `--calib ORG/NAME[@REVISION][:SPLIT]`: a dataset repo on the Hub (no local file of that name).
_DATASET_SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
                           r"(?:@(?P<rev>[^:@/\s]+))?(?::(?P<split>[\w.-]+))?$")
# The formats calib_data reads, as files of a dataset repo (README.md and the like are not data).
_DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".txt")


def is_dataset_spec(calib: str | Path | None) -> bool:
    """`--calib` names a Hub dataset: ORG/NAME[@REVISION][:SPLIT], no local file or folder of that
    name, and ORG not a local folder (then it is a mistyped path, which read_documents names)."""
    if not isinstance(calib, str) or Path(calib).exists():
        return False
    m = _DATASET_SPEC.match(calib)
    return m is not None and is_repo_id(m["repo"])


def split_files(files: list[str], split: str | None) -> list[str]:
    """The data files of `split` among a dataset repo's files, by the Hub's layout conventions:
    a folder named SPLIT, or a file named SPLIT.*, SPLIT-*.* or *-SPLIT.* / *_SPLIT.*
    (`data/train-00000-of-00003.parquet`, `train.jsonl`, `train/part-0.parquet`). No split
    given: the train split when there is one, else every data file. Sorted; [] when none."""
    data = sorted(f for f in files if PurePosixPath(f).suffix in _DATA_SUFFIXES
                  and not any(part.startswith(".") for part in PurePosixPath(f).parts))

    def of(f: str, sp: str) -> bool:
        pp = PurePosixPath(f)
        stem = pp.name.split(".", 1)[0]
        return (sp in pp.parts[:-1] or stem == sp or stem.startswith(sp + "-")
                or stem.endswith(("-" + sp, "_" + sp)))

    if split is not None:
        return [f for f in data if of(f, split)]
    return [f for f in data if of(f, "train")] or data


def resolve_dataset(spec: str) -> tuple[str, list[tuple[str, Path]]]:
    """A Hub dataset `--calib` -> (its name as reports show it, [(path in the repo, local file)]).

    The revision is pinned to the commit sha the Hub answers for REVISION (default main), the
    split's files are fetched with `hf_hub_download` into the standard Hub cache (so a dataset
    already downloaded, with `hf download --repo-type dataset` or by `datasets`, is not fetched
    again) and read in path order. The name is ORG/NAME@SHA:SPLIT, which pins what was read."""
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download

    m = _DATASET_SPEC.match(spec)
    repo, rev, split = m["repo"], m["rev"], m["split"]
    shown = f"{repo}@{rev}" if rev else repo
    with hub_errors(shown, "a readable dataset repo",
                    "check the dataset id (org/name, as on its Hub page) and @revision"):
        if constants.HF_HUB_OFFLINE:  # what an earlier run fetched, from the cache alone
            snap = Path(snapshot_download(repo, repo_type="dataset", revision=rev,
                                          local_files_only=True))
            sha = snap.name
            files = sorted(q.relative_to(snap).as_posix() for q in snap.rglob("*") if q.is_file())
        else:
            info = HfApi().dataset_info(repo, revision=rev)
            sha = info.sha
            files = [x.rfilename for x in info.siblings or []]
        chosen = split_files(files, split)
        if not chosen:
            have = ", ".join(f for f in files if PurePosixPath(f).suffix in _DATA_SUFFIXES)[:300]
            raise QuantizeError("no calibration data in this Hub dataset", [Problem(
                spec, None, (f"no data file of split {split!r}" if split else "no data file")
                + f" (data files: {have or 'none'})",
                ".parquet / .jsonl / .txt files with a text or messages column",
                "name the split after a colon (org/name:SPLIT), or pass a local file")])
        # by the revision as given, so the cache records refs/REV (an offline rerun finds it);
        # each file must come from the commit the listing was of
        local = [(f, Path(hf_hub_download(repo, f, repo_type="dataset", revision=rev)))
                 for f in chosen]
    moved = [f for f, q in local if f"/snapshots/{sha}/" not in q.as_posix()]
    if moved:
        raise QuantizeError("the Hub dataset changed during the download", [Problem(
            spec, None, f"{moved[0]} is not from commit {sha[:12]}", "one commit's files",
            f"re-run, or pin the commit: {repo}@{sha}" + (f":{split}" if split else ""))])
    used = split or ("train" if split_files(files, "train") else "all")
    return f"{repo}@{sha[:12]}:{used}", local
