"""Reads an MLflow run back through MLflow's own client, for tests/track/test_mlflow.cpp.

usage: mlflow_read.py TRACKING_URI RUN_ID DOWNLOAD_DIR

Prints one JSON object on stdout (anything MLflow logs goes to stderr): the run's status, name,
experiment name, params and tags; for every metric key, its history as [step, value, timestamp]
sorted by step; and every artifact file (recursively) as {path, size, sha256}, the sha256 of the
bytes downloaded from the server into DOWNLOAD_DIR.
"""

import hashlib
import json
import logging
import os
import sys


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def artifact_files(client, run_id, path=None):
    """Every file under `path` of the run's artifacts, depth first."""
    out = []
    for info in client.list_artifacts(run_id, path):
        if info.is_dir:
            out += artifact_files(client, run_id, info.path)
        else:
            out.append(info)
    return out


def main():
    uri, run_id, download = sys.argv[1:4]
    logging.basicConfig(stream=sys.stderr)
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    metrics = {}
    for key in run.data.metrics:
        history = client.get_metric_history(run_id, key)
        metrics[key] = sorted([m.step, m.value, m.timestamp] for m in history)
    files = []
    for info in artifact_files(client, run_id):
        local = client.download_artifacts(run_id, info.path, download)
        files.append({"path": info.path, "size": info.file_size, "sha256": sha256(local),
                      "downloaded_size": os.path.getsize(local)})
    print(json.dumps({
        "status": run.info.status,
        "run_name": run.info.run_name,
        "experiment": client.get_experiment(run.info.experiment_id).name,
        "params": run.data.params,
        "tags": run.data.tags,
        "metrics": metrics,
        "artifacts": files,
    }))


if __name__ == "__main__":
    main()
