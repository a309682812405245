"""`edgecore batch submit`: upload a JSONL file, create a batch, show progress, download results.

A batch paused on the core's full disk stays in progress: the progress line shows its message (no space left,
how much is needed) until it resumes; an upload the full disk refuses fails with the core's 507 message."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from edgecore.shared.errors import ConfigError, EdgecoreError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="submit and follow batch jobs on a core (OpenAI Batch API)",
                       description="Work with the batch API of a core's control port.")
    bsub = p.add_subparsers(dest="batch_command", metavar="ACTION")
    bsub.required = True
    s = bsub.add_parser("submit", help="upload a JSONL file and start a batch",
                        description="Upload FILE (OpenAI batch JSONL), create a batch; with --wait show a progress "
                                    "bar until it ends and download the results.")
    s.add_argument("file", help="batch input, one request per line")
    s.add_argument("--url", default="http://127.0.0.1:7101", help="core control port (default %(default)s)")
    s.add_argument("--endpoint", default="/v1/chat/completions",
                   choices=["/v1/chat/completions", "/v1/completions"])
    s.add_argument("--wait", action="store_true", help="follow progress until the batch ends")
    s.add_argument("--output", default=None, help="where to write the results (implies --wait)")
    s.add_argument("--api-key-file", default=None)
    s.set_defaults(func=run_submit)


class Api:
    def __init__(self, base: str, key: str | None):
        self.base = base.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def call(self, method: str, path: str, data: bytes | None = None, ctype: str | None = None) -> bytes:
        headers = dict(self.headers)
        if ctype:
            headers["Content-Type"] = ctype
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.read()
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except Exception:
                message = exc.reason
            raise EdgecoreError(f"{method} {path}: HTTP {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise EdgecoreError(f"cannot reach {self.base}: {exc}") from None

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        return json.loads(self.call(method, path, data, "application/json" if data else None))

    def upload(self, path: Path) -> dict:
        boundary = uuid.uuid4().hex
        parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode(),
                 f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name}"\r\n'
                 f'Content-Type: application/jsonl\r\n\r\n'.encode(), path.read_bytes(),
                 f"\r\n--{boundary}--\r\n".encode()]
        return json.loads(self.call("POST", "/v1/files", b"".join(parts), f"multipart/form-data; boundary={boundary}"))


def run_submit(args: argparse.Namespace) -> int:
    from edgecore.shared.node.secrets import read_api_keys
    path = Path(args.file)
    if not path.is_file():
        raise ConfigError(f"batch input {path} does not exist")
    keys = read_api_keys(args.api_key_file) if args.api_key_file else []
    api = Api(args.url, keys[0].decode() if keys else None)
    upload = api.upload(path)
    batch = api.json("POST", "/v1/batches", {"input_file_id": upload["id"], "endpoint": args.endpoint,
                                             "completion_window": "24h"})
    print(f"batch {batch['id']} created from {upload['id']} ({upload['bytes']} bytes)", file=sys.stderr)
    if not (args.wait or args.output):
        print(batch["id"])
        return 0
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.5)
        batch = api.json("GET", f"/v1/batches/{batch['id']}")
        c = batch["request_counts"]
        total = max(1, c["total"])
        filled = int(30 * (c["completed"] + c["failed"]) / total)
        paused = ((batch.get("errors") or {}).get("data") or [{}])[0].get("message", "")   # e.g. a full disk
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {c['completed']} done, {c['failed']} failed of "
                         f"{c['total']}  {batch['status']}{'  ' + paused if paused else ''}\x1b[K")
        sys.stderr.flush()
    sys.stderr.write("\n")
    if batch["status"] == "failed":
        errors = (batch.get("errors") or {}).get("data") or [{"message": "unknown"}]
        raise EdgecoreError(f"batch {batch['id']} failed: {errors[0]['message']}")
    out = Path(args.output) if args.output else Path(f"{batch['id']}_output.jsonl")
    if batch.get("output_file_id"):
        out.write_bytes(api.call("GET", f"/v1/files/{batch['output_file_id']}/content"))
        print(f"results: {out}", file=sys.stderr)
    if batch.get("error_file_id"):
        err = out.with_name(out.stem + "_errors.jsonl")
        err.write_bytes(api.call("GET", f"/v1/files/{batch['error_file_id']}/content"))
        print(f"errors: {err}", file=sys.stderr)
    print(batch["id"])
    return 0
