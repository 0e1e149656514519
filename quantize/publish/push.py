"""Publish a finished, verified output folder to the Hugging Face Hub.

    quantize push ./GLM-5.2-INT4 my-org/GLM-5.2-INT4 [--private] [--revision main] [--dry-run]

1. refuse what is not publishable: the manifest must be `complete` and every file it lists
   present with its recorded size and sha256 (every byte re-hashed: ~1 GB/s, minutes for
   GLM-5.2, against hours of upload; no override: an unfinished or altered conversion is never
   published); verify.json must say `ok`, name this manifest's sha256 (a report copied from
   another folder does not count) and be newer than the manifest (override: --skip-verify-check)
2. refresh README.md (the model card) with the repo id
3. the upload list is exactly: the manifest's files (re-hashed), README.md, the manifest
   itself, verify.json and eval.json when they name this manifest's sha256, and the pictures
   the card shows when a report of this conversion names their sha256 (verify.json: its SQNR
   picture and the calibration's routed-token picture; eval.json: its layer picture). Every
   one is a regular file inside the folder reached through no link: a link is refused by name
   (it could point anywhere on the machine). Nothing else in the folder (half-written
   `.partial` files, scratch) is sent
4. `upload` (the one network call site): create the repo if missing (private on request),
   create the branch if it is not `main`, then `HfApi.upload_folder` restricted to that list.
   huggingface_hub 2.x folded `upload_large_folder` into `upload_folder`: with hf_xet installed
   (the default) it is the streamed, multi-worker, multi-commit Xet upload, and re-running it
   after an interruption skips committed files and re-sends only missing chunks. Without hf_xet
   (or HF_HUB_DISABLE_XET=1) it is one commit over Git LFS, whose batch API skips the objects
   the Hub already holds, so a re-run sends only what is missing.

The token is huggingface_hub's business (HF_TOKEN or `hf auth login`): this module never passes,
prints or logs it, and scrubs it from any error message it re-raises.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from quantize import __version__
from quantize.check.verify import DEFAULT_MIN_SQNR_DB
from quantize.errors import Problem, QuantizeError
from quantize.names import CARD, EVAL_JSON, PICTURES, VERIFY_JSON
from quantize.publish.readme import card_text, write_readme
from quantize.source.checkpoint import escapes
from quantize.write.manifest import MANIFEST, finished_manifest
from quantize.write.shards import sha256_file

__all__ = ["PushPlan", "UploadFile", "prepare_push", "resolve_repo_id", "upload"]

_TOKEN_LIKE = re.compile(r"hf_[A-Za-z0-9]{8,}")


@dataclass(frozen=True)
class UploadFile:
    name: str  # path in the folder and in the repo
    nbytes: int


@dataclass(frozen=True)
class PushPlan:
    folder: Path
    repo_id: str
    revision: str
    private: bool
    files: tuple[UploadFile, ...]
    card: str  # the README.md that is (or would be) uploaded

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)


def resolve_repo_id(name: str, token: str | None = None) -> str:
    """ORG/NAME as given, or a bare NAME in the namespace of the token's user (`whoami`, one
    Hub request), as the hf CLI does. Offline, or without a login, a bare name is refused with
    the fix."""
    if "/" in name:
        return name
    from huggingface_hub import HfApi, constants

    from quantize.source.hub import http_errors

    fix = f"pass the full repo id, e.g. my-org/{name}"
    if getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)():
        raise QuantizeError("a bare repo name needs your Hub user name, and HF_HUB_OFFLINE is set",
                            [Problem(name, None, "no namespace", "ORG/NAME", fix)])
    try:
        user = HfApi(library_name="glm-int4-quantize", library_version=__version__,
                     token=token).whoami()["name"]
    except (OSError, *http_errors(), KeyError, ValueError) as e:
        raise QuantizeError("a bare repo name needs your Hub user name, and `whoami` failed",
                            [Problem(name, None, _scrub(f"{type(e).__name__}: {e}")[:200],
                                     "a login (HF_TOKEN or `hf auth login`)", fix)]) from None
    return f"{user}/{name}"


def _check_publishable(dst: Path, repo_id: str, skip_verify_check: bool) -> dict:
    """The manifest of a publishable folder; raises listing every reason it is not."""
    from quantize.source.hub import valid_repo_id

    if not valid_repo_id(repo_id):
        raise QuantizeError("not a Hub repo id", [Problem(
            repo_id, None, "not of the form org/name", "e.g. my-org/GLM-5.2-INT4",
            "pass the namespace and the repo name separated by one '/'")])
    manifest = finished_manifest(dst, ": refusing to publish it", "finish it with `quantize "
                                 "convert SRC DST --resume`, then `quantize verify SRC DST`")
    problems = []
    for name, rec in sorted(manifest["files"].items()):  # every byte, as it would be uploaded
        p = dst / name
        if (link := _not_plain(dst, name)) is not None:
            problems.append(link)
        elif not p.is_file():
            problems.append(Problem(str(p), None, "missing", f"{rec['bytes']} bytes",
                                    "re-run `quantize convert SRC DST --resume`"))
        elif p.stat().st_size != rec["bytes"]:
            problems.append(Problem(str(p), None, f"{p.stat().st_size} bytes",
                                    f"{rec['bytes']} bytes as converted",
                                    "the file changed after conversion; convert again with --overwrite"))
        elif sha256_file(p) != rec["sha256"]:
            problems.append(Problem(str(p), None, "sha256 differs from the manifest's",
                                    f"{rec['sha256'][:16]}... as converted",
                                    "the file changed after conversion (a disk or copy error?): "
                                    "convert again with --overwrite"))
    if problems:
        raise QuantizeError("the folder does not match its manifest: refusing to publish it", problems)
    if not skip_verify_check:
        _check_reports(dst)
    return manifest


def _check_reports(dst: Path) -> None:
    """verify.json passed, with the layer check, at the default floor, for this manifest and
    after it; eval.json, when there, did not find the output broken. Raises naming the file."""
    vpath = dst / VERIFY_JSON
    fix = "run `quantize verify SRC DST` (or pass --skip-verify-check to publish unverified)"
    if not vpath.is_file():
        raise QuantizeError("not verified: refusing to publish it", [Problem(
            str(vpath), None, "missing", "a passing verify report", fix)])
    if (link := _not_plain(dst, VERIFY_JSON)) is not None:
        raise QuantizeError("push uploads only files inside the folder", [link])
    report = read_report(vpath, fix)
    summary = report.get("summary")
    summary = summary if isinstance(summary, dict) else {}
    if summary.get("ok") is not True:
        raise QuantizeError("verify failed: refusing to publish it", [Problem(
            str(vpath), None, f"ok={summary.get('ok')}, problems={summary.get('problems', [])[:3]}, "
            f"failed={summary.get('failed', [])[:3]}", "ok=true", fix)])
    epath = dst / EVAL_JSON
    if epath.is_file() and _not_plain(dst, EVAL_JSON) is None:
        try:
            ev = json.loads(epath.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            ev = None  # (refused by name where push binds the reports: _bound_extras)
        v = ev.get("verdict") if isinstance(ev, dict) else None
        if ev is not None and not (isinstance(v, dict) and isinstance(v.get("ok"), bool)):
            raise QuantizeError("eval.json has no verdict: refusing to publish it", [Problem(
                str(epath), None, f"verdict={str(v)[:80]}", "eval's verdict (ok, the thresholds it "
                "used, what failed), as `quantize eval` writes it",
                "run `quantize eval SRC DST` again (or delete eval.json)")])
        if isinstance(v, dict) and v.get("ok") is False:
            raise QuantizeError("eval found the output broken: refusing to publish it", [Problem(
                str(epath), None, "; ".join(map(str, v.get("failed") or []))[:300],
                "a passing eval verdict", "reconvert (e.g. --method gptq), then run verify "
                "and eval again")])
    lc = summary.get("layer_check")
    if not isinstance(lc, dict) or lc.get("skipped") == "--no-layer-check" or \
            (lc.get("ok") is not True and "skipped" not in lc):
        raise QuantizeError("verify.json has no layer check: refusing to publish it", [Problem(
            str(vpath), None, f"layer_check={lc}", "each decoder layer of the output run against "
            "the source's (verify's default)", "run `quantize verify SRC DST` without "
            "--no-layer-check (or pass --skip-verify-check to publish unverified)")])
    if report.get("manifest_sha256") != sha256_file(dst / MANIFEST):
        raise QuantizeError("verify.json is not a report of this conversion: refusing to publish it",
                            [Problem(str(vpath), None, "written for another manifest (another "
                                     "folder, or this one before it changed)",
                                     f"the sha256 of {MANIFEST} as it is now", fix)])
    floor = report.get("min_sqnr_db_threshold")
    if not isinstance(floor, (int, float)) or not math.isfinite(floor) or floor < DEFAULT_MIN_SQNR_DB:
        raise QuantizeError("verify.json was checked against a lower SQNR floor: refusing to "
                            "publish it", [Problem(
                                str(vpath), None, f"--min-sqnr {floor}",
                                f"at least the default {DEFAULT_MIN_SQNR_DB:g} dB",
                                "run `quantize verify SRC DST` with the default floor (or pass "
                                "--skip-verify-check to publish what the lower floor passed)")])
    if vpath.stat().st_mtime_ns < (dst / MANIFEST).stat().st_mtime_ns:
        raise QuantizeError("verify.json is older than the conversion: refusing to publish it", [Problem(
            str(vpath), None, "written before the manifest's last change", "a report of this conversion",
            fix)])


def prepare_push(dst: str | Path, repo_id: str, revision: str = "main", private: bool = False,
                 skip_verify_check: bool = False, base_model: str | None = None,
                 write_card: bool = True) -> PushPlan:
    """Check `dst`, refresh its card (unless `write_card` is False: dry run) and list the upload."""
    dst = Path(dst)
    manifest = _check_publishable(dst, repo_id, skip_verify_check)
    if write_card:
        card = write_readme(dst, repo_id=repo_id, base_model=base_model).read_text()
    else:
        card = card_text(dst, repo_id=repo_id, base_model=base_model)
    files = [UploadFile(n, r["bytes"]) for n, r in sorted(manifest["files"].items())]
    files.append(UploadFile(CARD, len(card.encode())))
    for extra in (*_bound_extras(dst), MANIFEST):  # what the card quotes and shows
        files.append(UploadFile(extra, (dst / extra).stat().st_size))
    return PushPlan(dst, repo_id, revision, private, tuple(files), card)


def _not_plain(dst: Path, name: str) -> Problem | None:
    """None when DST/name is reached through no link and stays inside DST; else the problem,
    naming the link (what push uploads must be this folder's own bytes)."""
    parts = Path(name).parts
    for i in range(1, len(parts) + 1):
        q = dst.joinpath(*parts[:i])
        if q.is_symlink():
            return Problem(str(q), None, f"a link to {os.readlink(q)}",
                           "a regular file inside the output folder",
                           "push uploads only the folder's own files: replace the link with "
                           "the file it points to, or delete it")
    if escapes(dst, dst / name) is not None:  # (a `..` in a manifest's name)
        return Problem(str(dst / name), None, "a path leading outside the folder",
                       "a file inside the output folder", "reconvert with --overwrite")
    return None


def read_report(path: Path, fix: str) -> dict:
    """verify.json / eval.json as a JSON object, or a QuantizeError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise QuantizeError(f"{path.name} cannot be read: refusing to publish it", [Problem(
            str(path), None, f"{type(e).__name__}: {e}"[:200], "the JSON report quantize wrote",
            fix)]) from None
    if not isinstance(data, dict):
        raise QuantizeError(f"{path.name} is not a report: refusing to publish it", [Problem(
            str(path), None, f"a JSON {type(data).__name__}", "a JSON object", fix)])
    return data


def _bound_extras(dst: Path) -> list[str]:
    """verify.json, eval.json and the pictures that exist, each bound to this conversion:
    a report names the manifest's sha256, a picture's sha256 is named by such a report. Links,
    stale reports and pictures no report names are refused by name."""
    manifest_sha = sha256_file(dst / MANIFEST)
    drawn: dict[str, str] = {}  # picture -> sha256, as the reports of this conversion record
    names, problems = [], []
    for report, tool in ((VERIFY_JSON, "verify"), (EVAL_JSON, "eval")):
        if not os.path.lexists(dst / report):
            continue
        fix = f"run `quantize {tool} SRC DST` again (or delete {report})"
        if (link := _not_plain(dst, report)) is not None:
            problems.append(link)
            continue
        data = read_report(dst / report, fix)
        if data.get("manifest_sha256") != manifest_sha:
            problems.append(Problem(str(dst / report), None, "a report of another conversion (it "
                                    "names another manifest, or none)",
                                    f"the sha256 of {MANIFEST} as it is now", fix))
            continue
        names.append(report)
        pics = data.get("pictures")
        drawn.update({k: v for k, v in pics.items() if isinstance(v, str)} if isinstance(pics, dict) else {})
    for pic in PICTURES:
        if not os.path.lexists(dst / pic):
            continue
        if (link := _not_plain(dst, pic)) is not None:
            problems.append(link)
        elif drawn.get(pic) != sha256_file(dst / pic):
            problems.append(Problem(str(dst / pic), None, "a picture no report of this conversion "
                                    "drew (changed or copied in afterwards)",
                                    "the picture verify / eval drew, its sha256 in their report",
                                    "run `quantize verify SRC DST` (and `quantize eval`) again, "
                                    "or delete the picture"))
        else:
            names.append(pic)
    if problems:
        raise QuantizeError("files push would upload are not this conversion's: refusing to "
                            "publish them", problems)
    return names


def _scrub(text: str) -> str:
    from huggingface_hub import get_token

    token = get_token()
    if token:
        text = text.replace(token, "***")
    return _TOKEN_LIKE.sub("hf_***", text)


def upload(plan: PushPlan, token: str | None = None, commit_message: str | None = None,
           create_pr: bool = False) -> str:
    """Create the repo (and branch) if missing and upload `plan.files`; return the commit URL
    (with `create_pr`: the files go into a pull request against `plan.revision`; its URL).
    `token`: instead of HF_TOKEN / the stored login (never printed); `commit_message`: the
    commit's title (default: what is uploaded, by which tool version).

    The only function in the package that writes to the network; tests point it at a loopback
    Hub with HF_ENDPOINT.
    """
    from huggingface_hub import HfApi, constants

    from quantize.source.hub import http_errors

    if getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)():
        raise QuantizeError(f"cannot upload to {plan.repo_id}: HF_HUB_OFFLINE is set", [Problem(
            plan.repo_id, None, "huggingface_hub in offline mode (HF_HUB_OFFLINE=1)",
            "network access to the Hub", "unset HF_HUB_OFFLINE for the push (`--dry-run` lists "
            "the files without the network)")])
    api = HfApi(library_name="glm-int4-quantize", library_version=__version__, token=token)
    try:
        api.create_repo(plan.repo_id, private=plan.private, exist_ok=True, repo_type="model")
        if plan.revision != "main":
            api.create_branch(plan.repo_id, branch=plan.revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=plan.repo_id,
            folder_path=plan.folder,
            revision=plan.revision,
            allow_patterns=[glob.escape(f.name) for f in plan.files],
            commit_message=commit_message or f"Upload INT4 checkpoint ({len(plan.files)} files) with "
                                             f"glm-int4-quantize {__version__}",
            create_pr=create_pr,
        )
    except (OSError, *http_errors(), RuntimeError, ValueError) as e:  # HfHubHTTPError is an OSError
        msg = _scrub(str(e)) if token is None else _scrub(str(e)).replace(token, "***")
        raise QuantizeError(f"upload to {plan.repo_id} failed: {msg}", [Problem(
            plan.repo_id, None, type(e).__name__, "a finished upload",
            "check HF_TOKEN has write access to the namespace, then re-run the same `quantize push`: "
            "files already on the Hub are not sent again")]) from None
    if create_pr and getattr(info, "pr_url", None):
        return str(info.pr_url)
    return str(info.commit_url) if hasattr(info, "commit_url") else str(info)
