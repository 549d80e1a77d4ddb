#include "track/artifacts.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>

#include "data/mongo.hpp"
#include "data/mongo_handles.hpp"
#include "io/sha256.hpp"
#include "util/error.hpp"
#include "util/secrets.hpp"

namespace lorarun::track {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr const char* kBucket = "lorarun";
constexpr int32_t kChunkBytes = 1 << 20;   // GridFS chunk size: 1 MiB documents
constexpr size_t kBufferBytes = 4u << 20;  // what is read from a file at a time
constexpr int kChunksPerBatch = 8;         // chunks per reply when reading a file back

using data::BsonPtr;
using data::BucketDeleter;
using data::CollectionDeleter;
using data::CursorDeleter;
using data::DatabaseDeleter;
using StreamPtr = std::unique_ptr<mongoc_stream_t, data::StreamDeleter>;

// A query or option we wrote ourselves as BSON (a failure is a lorarun bug).
BsonPtr to_bson(const json& j) { return data::to_bson(j, "a GridFS query (a lorarun bug)"); }

// An ObjectId value from 24 hex digits.
bson_value_t oid_value(const std::string& hex) {
  bson_value_t v{};
  v.value_type = BSON_TYPE_OID;
  bson_oid_init_from_string(&v.value.v_oid, hex.c_str());
  return v;
}

// 24 hex digits of an ObjectId value ("" for another type).
std::string oid_hex(const bson_value_t& v) {
  if (v.value_type != BSON_TYPE_OID) return "";
  char hex[25];
  bson_oid_to_string(&v.value.v_oid, hex);
  return hex;
}

// The regular files under `dir`, sorted, as paths relative to it.
std::vector<fs::path> files_under(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out.push_back(e.path().lexically_relative(dir));
  std::sort(out.begin(), out.end());
  return out;
}

// An ArtifactFile from a GridFS files document (relaxed extended JSON).
ArtifactFile from_files_doc(const json& doc) {
  const json meta = doc.value("metadata", json::object());
  return {.artifact = meta.value("artifact", ""),
          .name = meta.value("name", ""),
          .bytes = meta.value("bytes", int64_t{0}),
          .sha256 = meta.value("sha256", ""),
          .file_id = doc.contains("_id") && doc["_id"].is_object() ? doc["_id"].value("$oid", "") : ""};
}

// A relative file name that stays inside the directory it is written to.
bool safe_name(const std::string& name) {
  const fs::path p(name);
  if (name.empty() || p.is_absolute()) return false;
  for (const fs::path& part : p)
    if (part == "..") return false;
  return true;
}

}  // namespace

struct ArtifactStore::Impl {
  data::Client client;
  std::string database;
  std::unique_ptr<mongoc_database_t, DatabaseDeleter> db;
  std::unique_ptr<mongoc_gridfs_bucket_t, BucketDeleter> bucket;
  UploadStats stats;

  Impl(const std::string& uri, const std::string& database, std::chrono::milliseconds timeout)
      : client(uri, timeout), database(database) {}

  // One file's upload: its chunks streamed from disk, then its files document. Returns its id.
  std::string put(const std::string& run_id, const std::string& artifact, const fs::path& dir, const fs::path& rel);
  // Deletes one GridFS file (its files document and chunks).
  void erase(const std::string& file_id);
  // Calls `take(data, size)` for each chunk of GridFS file `file_id`, in order, a few at a time
  // (the driver's download stream asks for every chunk in one reply, which FerretDB sends whole).
  template <class Take>
  void each_chunk(const std::string& file_id, const std::string& what, Take take);
  // Throws the driver's error `e` as one line beginning with `what`.
  [[noreturn]] void fail(const bson_error_t& e, const std::string& what) const { client.fail(e, what); }
};

ArtifactStore::ArtifactStore(const std::string& uri, const std::string& database, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>(uri, database, timeout)) {
  if (database.empty())
    throw Error("checkpoint.store: mongodb needs a database: set track.database (or data.database)");
  impl_->client.server_info();  // unreachable: the one-line error now
  impl_->db.reset(mongoc_client_get_database(impl_->client.native(), database.c_str()));
  const BsonPtr opts = to_bson({{"bucketName", kBucket}, {"chunkSizeBytes", kChunkBytes}});
  bson_error_t error;
  impl_->bucket.reset(mongoc_gridfs_bucket_new(impl_->db.get(), opts.get(), nullptr, &error));
  if (!impl_->bucket)
    impl_->fail(error, fmt::format("opening GridFS bucket {}.{} at {} failed", database, kBucket,
                                   impl_->client.redacted_uri()));
}

ArtifactStore::~ArtifactStore() = default;

const UploadStats& ArtifactStore::last_upload() const { return impl_->stats; }

std::string ArtifactStore::Impl::put(const std::string& run_id, const std::string& artifact, const fs::path& dir,
                                     const fs::path& rel) {
  const fs::path path = dir / rel;
  const std::string name = rel.generic_string();
  const auto bytes = static_cast<int64_t>(fs::file_size(path));
  const std::string sha = io::sha256_file(path.string());
  const std::string what = fmt::format("uploading {} of {} to GridFS {}.{} at {} failed", scrub(name), artifact,
                                       database, kBucket, client.redacted_uri());
  const BsonPtr opts = to_bson(
      {{"metadata", {{"run_id", run_id}, {"artifact", artifact}, {"name", name}, {"bytes", bytes}, {"sha256", sha}}}});
  bson_value_t id{};
  bson_error_t error;
  StreamPtr up(mongoc_gridfs_bucket_open_upload_stream(
      bucket.get(), fmt::format("{}/{}/{}", run_id, artifact, name).c_str(), opts.get(), &id, &error));
  if (!up) fail(error, what);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot read {} for the upload to GridFS: check its permissions", path.string()));
  std::vector<char> buf(kBufferBytes);
  int64_t sent = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto n = static_cast<size_t>(in.gcount());
    if (n == 0) break;
    if (mongoc_stream_write(up.get(), buf.data(), n, 0) != static_cast<ssize_t>(n)) {
      mongoc_gridfs_bucket_stream_error(up.get(), &error);
      mongoc_gridfs_bucket_abort_upload(up.get());  // best effort: deletes the chunks written so far
      fail(error, what);
    }
    sent += static_cast<int64_t>(n);
  }
  if (sent != bytes) {
    mongoc_gridfs_bucket_abort_upload(up.get());
    throw Error(fmt::format("{} changed size while it was uploaded ({} of {} bytes): it must not be written meanwhile",
                            path.string(), sent, bytes));
  }
  if (mongoc_stream_close(up.get()) != 0) {  // the last chunk and the files document
    mongoc_gridfs_bucket_stream_error(up.get(), &error);
    mongoc_gridfs_bucket_abort_upload(up.get());
    fail(error, what);
  }
  stats.bytes += bytes;
  return oid_hex(id);
}

template <class Take>
void ArtifactStore::Impl::each_chunk(const std::string& file_id, const std::string& what, Take take) {
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> chunks(
      mongoc_database_get_collection(db.get(), fmt::format("{}.chunks", kBucket).c_str()));
  const BsonPtr query = to_bson({{"files_id", {{"$oid", file_id}}}});
  const BsonPtr opts = to_bson({{"sort", {{"n", 1}}}, {"batchSize", kChunksPerBatch}});
  std::unique_ptr<mongoc_cursor_t, CursorDeleter> cur(
      mongoc_collection_find_with_opts(chunks.get(), query.get(), opts.get(), nullptr));
  const bson_t* doc = nullptr;
  int64_t expected = 0;
  while (mongoc_cursor_next(cur.get(), &doc)) {
    bson_iter_t it;
    if (!bson_iter_init_find(&it, doc, "n") || bson_iter_as_int64(&it) != expected)
      throw Error(fmt::format("{}: chunk {} is missing; the file is damaged", what, expected));
    ++expected;
    bson_subtype_t subtype;
    uint32_t n = 0;
    const uint8_t* data = nullptr;
    if (!bson_iter_init_find(&it, doc, "data") || !BSON_ITER_HOLDS_BINARY(&it))
      throw Error(fmt::format("{}: chunk {} holds no binary data; the file is damaged", what, expected - 1));
    bson_iter_binary(&it, &subtype, &n, &data);
    take(data, n);
  }
  bson_error_t error;
  if (mongoc_cursor_error(cur.get(), &error)) fail(error, what);
}

void ArtifactStore::Impl::erase(const std::string& file_id) {
  const bson_value_t id = oid_value(file_id);
  bson_error_t error;
  if (!mongoc_gridfs_bucket_delete_by_id(bucket.get(), &id, &error))
    fail(error, fmt::format("deleting GridFS file {} from {}.{} at {} failed", file_id, database, kBucket,
                            client.redacted_uri()));
}

std::vector<ArtifactFile> ArtifactStore::upload(const std::string& run_id, const std::string& artifact,
                                                const std::string& dir) {
  const auto t0 = Clock::now();
  impl_->stats = {};
  const std::vector<ArtifactFile> old = list(run_id, artifact);
  std::vector<ArtifactFile> done;
  try {
    for (const fs::path& rel : files_under(dir)) {
      ArtifactFile f;
      f.artifact = artifact;
      f.name = rel.generic_string();
      f.file_id = impl_->put(run_id, artifact, dir, rel);
      done.push_back(std::move(f));
    }
  } catch (...) {
    for (const ArtifactFile& f : done) try {
        impl_->erase(f.file_id);  // a half-uploaded artifact never stands next to the complete one
      } catch (const std::exception&) {
      }
    throw;
  }
  for (const ArtifactFile& f : old) impl_->erase(f.file_id);  // the new copy is complete: the old one goes
  impl_->stats.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return list(run_id, artifact);
}

std::vector<ArtifactFile> ArtifactStore::list(const std::string& run_id, const std::string& artifact) {
  json filter = {{"metadata.run_id", run_id}};
  if (!artifact.empty()) filter["metadata.artifact"] = artifact;
  const BsonPtr query = to_bson(filter);
  std::unique_ptr<mongoc_cursor_t, CursorDeleter> cur(
      mongoc_gridfs_bucket_find(impl_->bucket.get(), query.get(), nullptr));
  std::vector<ArtifactFile> out;
  const bson_t* doc = nullptr;
  while (mongoc_cursor_next(cur.get(), &doc)) {
    char* text = bson_as_relaxed_extended_json(doc, nullptr);
    const json j = json::parse(text, nullptr, false);
    bson_free(text);
    if (j.is_object()) out.push_back(from_files_doc(j));
  }
  bson_error_t error;
  if (mongoc_cursor_error(cur.get(), &error))
    impl_->fail(error, fmt::format("listing GridFS {}.{} at {} failed", impl_->database, kBucket,
                                   impl_->client.redacted_uri()));
  std::sort(out.begin(), out.end(), [](const ArtifactFile& a, const ArtifactFile& b) {
    return std::tie(a.artifact, a.name) < std::tie(b.artifact, b.name);
  });
  return out;
}

std::vector<ArtifactFile> ArtifactStore::download(const std::string& run_id, const std::string& artifact,
                                                  const std::string& dir) {
  const std::vector<ArtifactFile> files = list(run_id, artifact);
  if (files.empty())
    throw Error(fmt::format("run {} has no artifact '{}' in GridFS {}.{} at {}: `lora-runs show {}` lists what it has",
                            run_id, artifact, impl_->database, kBucket, impl_->client.redacted_uri(), run_id));
  for (const ArtifactFile& f : files) {
    if (!safe_name(f.name))
      throw Error(fmt::format("GridFS file {} of run {} is named '{}', which leaves the directory: refusing it",
                              f.file_id, run_id, scrub(f.name)));
    const fs::path path = fs::path(dir) / f.name;
    fs::create_directories(path.parent_path());
    const fs::path tmp = path.string() + ".part";
    const std::string what = fmt::format("downloading {} of {}/{} from GridFS at {} failed", scrub(f.name), run_id,
                                         artifact, impl_->client.redacted_uri());
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(fmt::format("cannot write {}: check that the directory is writable", tmp.string()));
    io::Sha256 sha;
    int64_t got = 0;
    try {
      impl_->each_chunk(f.file_id, what, [&](const uint8_t* data, uint32_t n) {
        sha.update(data, n);
        out.write(reinterpret_cast<const char*>(data), n);
        got += n;
      });
    } catch (...) {
      out.close();
      fs::remove(tmp);
      throw;
    }
    out.close();
    const std::string hex = sha.hex();
    if (!out || got != f.bytes || hex != f.sha256) {
      fs::remove(tmp);
      throw Error(
          fmt::format("{} of {}/{} in GridFS is damaged: {} bytes with sha256 {}, its metadata says {} bytes "
                      "with sha256 {}; nothing was kept",
                      scrub(f.name), run_id, artifact, got, hex, f.bytes, f.sha256));
    }
    fs::rename(tmp, path);
  }
  return files;
}

int64_t ArtifactStore::remove(const std::string& run_id, const std::string& artifact) {
  const std::vector<ArtifactFile> files = list(run_id, artifact);
  for (const ArtifactFile& f : files) impl_->erase(f.file_id);
  return static_cast<int64_t>(files.size());
}

std::pair<std::string, std::string> split_run_ref(const std::string& ref) {
  const size_t slash = ref.find('/');
  if (slash == std::string::npos) return {ref, ""};
  return {ref.substr(0, slash), ref.substr(slash + 1)};
}

}  // namespace lorarun::track
