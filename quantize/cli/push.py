"""`quantize push`: a verified output folder to the Hub with its model card."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quantize.cli.app import app, err, out, print_json, tag
from quantize.cli.params import Debug, Json


@app.command()
def push(
    dst: Annotated[Path, typer.Argument(help="A converted and verified output folder.")],
    repo_id: Annotated[str, typer.Argument(
        help="Hub repo id org/name (created if missing); a bare name goes into your own namespace.")],
    private: Annotated[bool, typer.Option(help="Create the repo private (an existing repo keeps "
                                               "its visibility).")] = False,
    revision: Annotated[str, typer.Option(help="Branch to push to (created from main if missing).")] = "main",
    dry_run: Annotated[bool, typer.Option(help="List the files and sizes and print the card; "
                                               "upload nothing.")] = False,
    skip_verify_check: Annotated[bool, typer.Option(
        help="Publish even without a passing verify.json (the manifest must still be complete).")] = False,
    base_model: Annotated[str | None, typer.Option(
        help="The card's base_model (default: the Hub repo the source was downloaded from).")] = None,
    token: Annotated[str | None, typer.Option(
        help="Hub token with write access (default: HF_TOKEN or `hf auth login`); never printed.",
        envvar=None)] = None,
    commit_message: Annotated[str | None, typer.Option(
        help="The commit's title (default: 'Upload INT4 checkpoint (N files) with glm-int4-quantize V').")] = None,
    create_pr: Annotated[bool, typer.Option(
        help="Open a pull request against --revision instead of committing to it (a repo you "
             "may not write to directly, or a review first).")] = False,
    json_: Json = False,
    debug: Debug = False,
) -> None:
    """Upload DST to the Hugging Face Hub with a model card (README.md), resumably.

    Refuses a folder whose manifest is not complete or that has no passing verify.json. Uploads
    exactly the manifest's files plus README.md, verify.json and the manifest. Re-running after an
    interruption sends only what is missing. The token comes from HF_TOKEN or `hf auth login`.

    Examples:
      quantize push ./GLM-5.2-INT4 my-org/GLM-5.2-INT4 --dry-run
      quantize push ./GLM-5.2-INT4 my-org/GLM-5.2-INT4 --private
      quantize push ./GLM-5.2-INT4 my-org/GLM-5.2-INT4 --commit-message "INT4 g32, GPTQ 512x2048"
      quantize push ./GLM-5.2-INT4 GLM-5.2-INT4                   # into your user namespace
      quantize push ./GLM-5.2-INT4 their-org/GLM-5.2-INT4 --create-pr
    """
    from quantize.publish.push import prepare_push, resolve_repo_id, upload
    from quantize.sizes import fmt_bytes

    repo_id = resolve_repo_id(repo_id, token)
    p = prepare_push(dst, repo_id, revision, private, skip_verify_check, base_model,
                     write_card=not dry_run)
    if not any(f.name == "eval.json" for f in p.files):  # the card then has no accuracy figures
        err.print(tag("warning:", "yellow"), f"{dst} has no eval.json: the card will say nothing of "
                  "the output's accuracy; run `quantize eval SRC DST` first (perplexity and KL "
                  "against the source)", highlight=False)
    files = {"repo_id": p.repo_id, "revision": p.revision, "private": p.private,
             "files": [{"name": f.name, "bytes": f.nbytes} for f in p.files],
             "total_bytes": p.total_bytes}
    if dry_run and json_:
        print_json({**files, "dry_run": True})
    elif dry_run:
        for f in p.files:
            out.print(f"{f.nbytes:>16,}  {f.name}", highlight=False, soft_wrap=True)
        out.print(f"{p.total_bytes:>16,}  total: {len(p.files)} files ({fmt_bytes(p.total_bytes)}) "
                  f"-> {p.repo_id}@{p.revision}{' (private)' if p.private else ''}",
                  highlight=False, soft_wrap=True)
        out.print("\n" + p.card, markup=False, highlight=False, soft_wrap=True)
    else:
        err.print(f"uploading {len(p.files)} files ({fmt_bytes(p.total_bytes)}) to {p.repo_id}"
                  f"@{p.revision}", highlight=False)
        url = upload(p, token=token, commit_message=commit_message, create_pr=create_pr)
        if json_:
            print_json({**files, "dry_run": False, "create_pr": create_pr, "url": url})
        else:
            out.print(url, highlight=False, soft_wrap=True)
