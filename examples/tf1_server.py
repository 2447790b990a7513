"""One task of a TF1-style cluster: TF1's ``tf.train.Server(cluster, job_name, task_index).join()``.

Start it once per task, each in its own interpreter (the TF1 article's three terminals), with
the same PHALANX_CLUSTER_TOKEN and this task named in TF_CONFIG:

    export PHALANX_CLUSTER_TOKEN=$(python -c "import secrets; print(secrets.token_hex(16))")
    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"], "ps": ["127.0.0.1:2224"]},
                "task": {"type": "worker", "index": 0}}' python examples/tf1_server.py

Then drive the cluster from anywhere with examples/tf1_client.py.
"""

import phalanx

resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
job_name, task_index = resolver.task_type, resolver.task_id
server = phalanx.train.Server(resolver.cluster_spec(), job_name=job_name, task_index=task_index)
print(f"serving {job_name}:{task_index}", flush=True)
server.join()  # serves until the process is stopped
