"""Prints its task and torchrun's variables; behaves as told by MODE (ok, fail, sleep)."""

import json
import os
import sys
import time

mode = sys.argv[1]
task = json.loads(os.environ["TF_CONFIG"])["task"]
print(
    f"task {task['type']}:{task['index']} rank={os.environ.get('RANK')} world={os.environ.get('WORLD_SIZE')}"
)
if mode == "fail" and task["index"] == 1:
    sys.exit(3)
if mode in ("sleep", "fail"):
    time.sleep(60)
