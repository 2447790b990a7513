"""A launcher test task: prints who it is, then behaves as its first argument says.

Modes: ``ok`` exits 0; ``fail`` makes worker 1 exit 3 once worker 0 has written its pid and
its child's pid to the folder in argv[2] (worker 0 then sleeps); ``sleep`` sleeps; ``streams``
prints one line to stdout and one to stderr. A ps task always serves (sleeps) until stopped.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

mode = sys.argv[1]
task = json.loads(os.environ["TF_CONFIG"])["task"]
env = os.environ
print(
    f"task {task['type']}:{task['index']} rank={env.get('RANK')} world={env.get('WORLD_SIZE')} "
    f"local={env.get('LOCAL_RANK')}/{env.get('LOCAL_WORLD_SIZE')} "
    f"master={env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
)
if mode == "streams":
    print("to stderr", file=sys.stderr)
if task["type"] == "ps" or mode == "sleep":
    time.sleep(60)
if mode == "ok" and task["type"] == "chief":
    time.sleep(2)  # a chief + ps cluster ends with the chief: let the other tasks print first
if mode == "fail":
    pids = Path(sys.argv[2]) / "pids"
    if task["index"] == 1:
        while not pids.exists():
            time.sleep(0.01)
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (pids.parent / "tmp").write_text(f"{os.getpid()} {child.pid}")
    (pids.parent / "tmp").rename(pids)
    time.sleep(60)
