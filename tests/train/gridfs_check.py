"""What pymongo's own GridFS reads of a run's artifacts (checkpoint.store: mongodb).

  gridfs_check.py URI DB RUN_ID OUTPUT_DIR

Prints one JSON object on stdout: {"files": [{artifact, name, bytes, sha256 (of the bytes read),
metadata, identical (to OUTPUT_DIR/<artifact>/<name>)}], "files_docs", "chunks_docs"} where the
counts are of the run's documents in lorarun.files and lorarun.chunks.
"""
import hashlib
import json
import os
import sys

import gridfs
import pymongo


def main():
    uri, db_name, run_id, out = sys.argv[1:5]
    client = pymongo.MongoClient(uri, serverSelectionTimeoutMS=5000)
    db = client[db_name]
    bucket = gridfs.GridFSBucket(db, bucket_name="lorarun")
    files = []
    ids = []
    for grid_out in bucket.find({"metadata.run_id": run_id}):
        data = grid_out.read()
        meta = grid_out.metadata or {}
        local = os.path.join(out, meta.get("artifact", ""), meta.get("name", ""))
        identical = os.path.isfile(local) and open(local, "rb").read() == data
        ids.append(grid_out._id)
        files.append({"artifact": meta.get("artifact"), "name": meta.get("name"), "bytes": len(data),
                      "sha256": hashlib.sha256(data).hexdigest(), "metadata": meta, "identical": identical})
    chunks = db["lorarun.chunks"].count_documents({"files_id": {"$in": ids}}) if ids else 0
    print(json.dumps({"files": files, "files_docs": db["lorarun.files"].count_documents({"metadata.run_id": run_id}),
                      "chunks_docs": chunks, "all_chunks": db["lorarun.chunks"].count_documents({})}))


if __name__ == "__main__":
    main()
