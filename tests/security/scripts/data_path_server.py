"""A real `RpcServer` on 127.0.0.1 serving ``assign`` on the data path (as a ps task does).

``assign`` appends a line to a canary file naming the header and the sum of the tensor it
received, and sends the tensor back. It prints ``port <n>`` once serving, then serves until
its standard input closes. The token, ``PHALANX_INSECURE_TRANSPORT`` and
``PHALANX_MAX_MESSAGE_BYTES`` come from the environment.

usage: data_path_server.py CANARY
"""

import sys
from pathlib import Path

from phalanx.ps.transport import RpcServer
from phalanx.security.token import cluster_token

canary = Path(sys.argv[1])


def assign(header, tensors):
    with canary.open("a") as out:
        out.write(f"ran {header} {int(sum(int(t.sum()) for t in tensors))}\n")
    return {"ok": True}, tensors


server = RpcServer(
    "127.0.0.1", 0, cluster_token(), {"assign": assign}, name="ps:0 (test)", data_methods=["assign"]
)
server.start()
print("port", server.port, flush=True)
sys.stdin.read()
server.stop(grace=0)
