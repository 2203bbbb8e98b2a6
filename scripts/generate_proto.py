"""Regenerate the committed protobuf module from proto/handoff/v1/handoff.proto.

Run after every change to the .proto: `python scripts/generate_proto.py` (needs grpcio-tools, in the `test` extra).
tests/test_wire.py fails when the committed module no longer matches the .proto.

Only the message module is generated: the service's method paths are read off its descriptor at run time
(handoff_client/protocol/wire.py), so no generated stub code needs its imports patched.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO = PROTO_ROOT / "handoff" / "v1" / "handoff.proto"
OUT = ROOT / "client" / "protocol" / "messages"


def generate(out_dir: Path) -> list[Path]:
    """Compile the .proto into `out_dir`, returning the files written."""
    from grpc_tools import protoc  # a build-time tool, not a run-time dependency

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}", str(PROTO)]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {PROTO}")
        written = []
        for name in ("handoff_pb2.py", "handoff_pb2.pyi"):
            target = out_dir / name
            shutil.copyfile(Path(tmp) / "handoff" / "v1" / name, target)
            written.append(target)
        return written


if __name__ == "__main__":
    for path in generate(OUT if len(sys.argv) < 2 else Path(sys.argv[1])):
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
