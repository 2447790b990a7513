"""A real `RpcServer` on 127.0.0.1 whose only method, ``run``, appends a line to a canary file.

It prints ``port <n>`` once serving, then serves until its standard input closes. The token,
``PHALANX_INSECURE_TRANSPORT`` and ``PHALANX_MAX_MESSAGE_BYTES`` come from the environment.

usage: rpc_server.py CANARY
"""

import sys
from pathlib import Path

from phalanx.ps.transport import RpcServer
from phalanx.security.token import cluster_token

canary = Path(sys.argv[1])


def run(header, tensors):
    with canary.open("a") as out:
        out.write(f"ran {header}\n")
    return {"ok": True}, []


server = RpcServer("127.0.0.1", 0, cluster_token(), {"run": run}, name="worker:0 (test)")
server.start()
print("port", server.port, flush=True)
sys.stdin.read()
server.stop(grace=0)
