#include "track/artifacts.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "data/mongo.hpp"
#include "data/mongo_handles.hpp"
#include "io/files.hpp"
#include "io/sha256.hpp"
#include "util/error.hpp"
#include "util/secrets.hpp"
#include "util/untrusted.hpp"

namespace lorarun::track {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr const char* kBucket = "lorarun";
// GridFS files that are not, or no longer, part of an artifact: an upload not yet complete, or
// files being deleted, one document each {_id, run_id, artifact, files: [file ids]}. list() never
// shows them, a whole upload becomes visible at once (its document deleted), and what a server or
// process lost mid-transfer leaves behind is found and removed from here.
constexpr const char* kPending = "lorarun.pending";
constexpr int32_t kChunkBytes = 1 << 20;  // GridFS chunk size: 1 MiB documents
constexpr int kChunksPerBatch = 8;        // chunks per reply when reading a file back

using data::BsonPtr;
using data::BucketDeleter;
using data::CollectionDeleter;
using data::CursorDeleter;
using data::DatabaseDeleter;

// A query or option we wrote ourselves as BSON (a failure is a lorarun bug).
BsonPtr to_bson(const json& j) { return data::to_bson(j, "a GridFS query (a lorarun bug)"); }

// A new ObjectId as 24 hex digits.
std::string new_oid() {
  bson_oid_t oid;
  bson_oid_init(&oid, nullptr);
  char hex[25];
  bson_oid_to_string(&oid, hex);
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

}  // namespace

struct ArtifactStore::Impl {
  data::Client client;
  std::string database;
  std::unique_ptr<mongoc_database_t, DatabaseDeleter> db;
  std::unique_ptr<mongoc_gridfs_bucket_t, BucketDeleter> bucket;  // finds and deletes
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> files, chunks;
  bool indexed = false;
  UploadStats stats;

  Impl(const std::string& uri, const std::string& database, std::chrono::milliseconds timeout)
      : client(uri, timeout), database(database) {}

  // One file's upload as GridFS file `id`: its chunks streamed from disk, then its files document.
  void put(const std::string& id, const std::string& run_id, const std::string& artifact, const fs::path& dir,
           const fs::path& rel);
  // Creates the bucket's indexes (once per store).
  void index();
  // Marks `files` of run `run_id` pending, then deletes every pending file of the run: its chunks,
  // its files document, its entry in kPending (in that order, so a cut leaves it pending).
  void purge(const std::string& run_id, const std::vector<ArtifactFile>& files = {});
  // Calls `take(data, size)` for each chunk of GridFS file `file_id`, in order, a few at a time
  // (the driver's download stream asks for every chunk in one reply, which FerretDB sends whole).
  template <class Take>
  void each_chunk(const std::string& file_id, const std::string& what, Take take);
  // Writes GridFS file f.file_id to `path` (its directory made), checked against f's size and
  // sha256; a mismatch or a failure removes what was written and throws one line.
  void fetch_file(const std::string& run_id, const std::string& artifact, const ArtifactFile& f, const fs::path& path);
  // Throws the driver's error `e` as one line beginning with `what`.
  [[noreturn]] void fail(const bson_error_t& e, const std::string& what) const { client.fail(e, what); }
};

ArtifactStore::ArtifactStore(const std::string& uri, const std::string& database, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>(uri, database, timeout)) {
  if (database.empty())
    throw Error("checkpoint.store: mongodb needs a database: set track.database (or data.database)");
  impl_->client.server_info();  // unreachable: the one-line error now
  impl_->db.reset(mongoc_client_get_database(impl_->client.native(), database.c_str()));
  impl_->files.reset(mongoc_database_get_collection(impl_->db.get(), fmt::format("{}.files", kBucket).c_str()));
  impl_->chunks.reset(mongoc_database_get_collection(impl_->db.get(), fmt::format("{}.chunks", kBucket).c_str()));
  const BsonPtr opts = to_bson({{"bucketName", kBucket}, {"chunkSizeBytes", kChunkBytes}});
  bson_error_t error;
  impl_->bucket.reset(mongoc_gridfs_bucket_new(impl_->db.get(), opts.get(), nullptr, &error));
  if (!impl_->bucket)
    impl_->fail(error, fmt::format("opening GridFS bucket {}.{} at {} failed", database, kBucket,
                                   impl_->client.redacted_uri()));
}

ArtifactStore::~ArtifactStore() = default;

const UploadStats& ArtifactStore::last_upload() const { return impl_->stats; }

void ArtifactStore::prepare() {
  if (!impl_->indexed) impl_->index();
}

// The chunks and the files document are written here, as the GridFS spec lays them out, not
// through the driver's upload stream: libmongoc 1.23's stream retries a chunk it failed to insert
// for ever (a server lost mid-upload would hang the run).
void ArtifactStore::Impl::put(const std::string& id, const std::string& run_id, const std::string& artifact,
                              const fs::path& dir, const fs::path& rel) {
  const fs::path path = dir / rel;
  const std::string name = rel.generic_string();
  const auto bytes = static_cast<int64_t>(fs::file_size(path));
  const std::string sha = io::sha256_file(path.string());
  const std::string what = fmt::format("uploading {} of {} to GridFS {}.{} at {} failed", scrub(name), artifact,
                                       database, kBucket, client.redacted_uri());
  bson_oid_t file_id;
  bson_oid_init_from_string(&file_id, id.c_str());
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot read {} for the upload to GridFS: check its permissions", path.string()));
  std::vector<char> buf(kChunkBytes);
  bson_error_t error;
  int64_t sent = 0;
  for (int32_t n = 0; in; ++n) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto got = static_cast<uint32_t>(in.gcount());
    if (got == 0) break;
    bson_t chunk = BSON_INITIALIZER;
    bson_oid_t chunk_id;
    bson_oid_init(&chunk_id, nullptr);
    BSON_APPEND_OID(&chunk, "_id", &chunk_id);
    BSON_APPEND_OID(&chunk, "files_id", &file_id);
    BSON_APPEND_INT32(&chunk, "n", n);
    BSON_APPEND_BINARY(&chunk, "data", BSON_SUBTYPE_BINARY, reinterpret_cast<const uint8_t*>(buf.data()), got);
    const bool ok = mongoc_collection_insert_one(chunks.get(), &chunk, nullptr, nullptr, &error);
    bson_destroy(&chunk);
    if (!ok) fail(error, what);
    sent += got;
  }
  if (sent != bytes)
    throw Error(fmt::format("{} changed size while it was uploaded ({} of {} bytes): it must not be written meanwhile",
                            path.string(), sent, bytes));
  // The files document last: until it is written, the file does not exist for a reader.
  const BsonPtr meta =
      to_bson({{"run_id", run_id}, {"artifact", artifact}, {"name", name}, {"bytes", bytes}, {"sha256", sha}});
  const std::string filename = fmt::format("{}/{}/{}", run_id, artifact, name);
  bson_t file = BSON_INITIALIZER;
  BSON_APPEND_OID(&file, "_id", &file_id);
  BSON_APPEND_INT64(&file, "length", bytes);
  BSON_APPEND_INT32(&file, "chunkSize", kChunkBytes);
  BSON_APPEND_DATE_TIME(
      &file, "uploadDate",
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
  BSON_APPEND_UTF8(&file, "filename", filename.c_str());
  BSON_APPEND_DOCUMENT(&file, "metadata", meta.get());
  const bool ok = mongoc_collection_insert_one(files.get(), &file, nullptr, nullptr, &error);
  bson_destroy(&file);
  if (!ok) fail(error, what);
  stats.bytes += bytes;
}

// The indexes a GridFS bucket has before its first write (those drivers create): chunks by file
// and number (unique), files by name and date.
void ArtifactStore::Impl::index() {
  const BsonPtr command =
      to_bson({{"createIndexes", fmt::format("{}.chunks", kBucket)},
               {"indexes", {{{"key", {{"files_id", 1}, {"n", 1}}}, {"name", "files_id_1_n_1"}, {"unique", true}}}}});
  const BsonPtr files_command =
      to_bson({{"createIndexes", fmt::format("{}.files", kBucket)},
               {"indexes", {{{"key", {{"filename", 1}, {"uploadDate", 1}}}, {"name", "filename_1_uploadDate_1"}}}}});
  bson_error_t error;
  for (const BsonPtr* c : {&command, &files_command})
    if (!mongoc_database_write_command_with_opts(db.get(), c->get(), nullptr, nullptr, &error))
      fail(error,
           fmt::format("creating the indexes of GridFS {}.{} at {} failed", database, kBucket, client.redacted_uri()));
  indexed = true;
}

void ArtifactStore::Impl::purge(const std::string& run_id, const std::vector<ArtifactFile>& files) {
  if (!files.empty()) {
    json ids = json::array();
    for (const ArtifactFile& f : files) ids.push_back({{"$oid", f.file_id}});
    client.insert_one(database, kPending, {{"run_id", run_id}, {"artifact", files.front().artifact}, {"files", ids}});
  }
  for (const json& pending : client.find(database, kPending, {{"run_id", run_id}})) {
    for (const json& id : pending.value("files", json::array())) {
      client.delete_many(database, fmt::format("{}.chunks", kBucket), {{"files_id", id}});
      client.delete_many(database, fmt::format("{}.files", kBucket), {{"_id", id}});
    }
    client.delete_many(database, kPending, {{"_id", pending.at("_id")}});
  }
}

template <class Take>
void ArtifactStore::Impl::each_chunk(const std::string& file_id, const std::string& what, Take take) {
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

void ArtifactStore::Impl::fetch_file(const std::string& run_id, const std::string& artifact, const ArtifactFile& f,
                                     const fs::path& path) {
  const std::string what =
      fmt::format("downloading {} of {}/{} from GridFS at {} failed", f.name, run_id, artifact, client.redacted_uri());
  fs::create_directories(path.parent_path());
  io::OutFile out(path.string(), io::OutFile::Mode::Truncate);
  io::Sha256 sha;
  int64_t got = 0;
  each_chunk(f.file_id, what, [&](const uint8_t* data, uint32_t n) {
    got += n;
    if (got > f.bytes)  // never more than the record says: a file is not allowed to fill the disk
      throw Error(fmt::format("{} of {}/{} in GridFS is damaged: it holds more than the {} bytes its record says",
                              f.name, run_id, artifact, f.bytes));
    sha.update(data, n);
    out.write(data, n);
  });
  const std::string hex = sha.hex();
  if (got != f.bytes || hex != f.sha256)
    throw Error(
        fmt::format("{} of {}/{} in GridFS is damaged: {} bytes with sha256 {}, its record says {} bytes with "
                    "sha256 {}; nothing was kept",
                    f.name, run_id, artifact, got, hex, f.bytes, f.sha256));
}

std::vector<ArtifactFile> ArtifactStore::upload(const std::string& run_id, const std::string& artifact,
                                                const std::string& dir) {
  const auto t0 = Clock::now();
  impl_->stats = {};
  prepare();
  impl_->purge(run_id);  // what an earlier upload or removal of this run was cut short in left
  // Each file is listed in the upload's kPending document before its first chunk; the artifact's
  // new files count only once all are complete and that one document is deleted. Until then
  // list() does not show them, and a failure (here, or a server or process lost mid-transfer)
  // leaves what purge() removes.
  const std::string upload_id = new_oid();
  const json pending = {{"_id", {{"$oid", upload_id}}}};
  std::set<std::string> ids;  // the new copy's files
  try {
    impl_->client.insert_one(
        impl_->database, kPending,
        {{"_id", {{"$oid", upload_id}}}, {"run_id", run_id}, {"artifact", artifact}, {"files", json::array()}});
    for (const fs::path& rel : files_under(dir)) {
      const std::string id = new_oid();
      ids.insert(id);
      impl_->client.update_one(impl_->database, kPending, pending, {{"$push", {{"files", {{"$oid", id}}}}}});
      impl_->put(id, run_id, artifact, dir, rel);
    }
    impl_->client.delete_many(impl_->database, kPending, pending);
  } catch (...) {
    try {
      impl_->purge(run_id);            // a half-uploaded artifact never stands next to the complete one
    } catch (const std::exception&) {  // the server is gone: the next upload or `remove` purges it
    }
    throw;
  }
  // The new copy is complete; the old one stays until the caller's record lists the new one (retire).
  impl_->stats.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<ArtifactFile> out = list(run_id, artifact);
  std::erase_if(out, [&](const ArtifactFile& f) { return !ids.count(f.file_id); });
  return out;
}

void ArtifactStore::retire(const std::string& run_id, const std::string& artifact,
                           const std::vector<ArtifactFile>& keep) {
  std::set<std::string> kept;
  for (const ArtifactFile& f : keep) kept.insert(f.file_id);
  std::vector<ArtifactFile> gone;
  for (const json& doc : impl_->client.find(impl_->database, fmt::format("{}.files", kBucket),
                                            {{"metadata.run_id", run_id}, {"metadata.artifact", artifact}})) {
    ArtifactFile f = from_files_doc(doc);
    if (!kept.count(f.file_id)) gone.push_back(std::move(f));
  }
  if (!gone.empty()) impl_->purge(run_id, gone);
}

std::vector<ArtifactFile> ArtifactStore::list(const std::string& run_id, const std::string& artifact) {
  json filter = {{"metadata.run_id", run_id}};
  if (!artifact.empty()) filter["metadata.artifact"] = artifact;
  const BsonPtr query = to_bson(filter);
  std::unique_ptr<mongoc_cursor_t, CursorDeleter> cur(
      mongoc_gridfs_bucket_find(impl_->bucket.get(), query.get(), nullptr));
  std::set<std::string> unfinished;
  for (const json& pending : impl_->client.find(impl_->database, kPending, {{"run_id", run_id}}))
    for (const json& id : pending.value("files", json::array())) unfinished.insert(id.value("$oid", ""));
  std::vector<std::pair<int64_t, ArtifactFile>> found;  // (upload time in ms, file)
  const bson_t* doc = nullptr;
  while (mongoc_cursor_next(cur.get(), &doc)) {
    char* text = bson_as_relaxed_extended_json(doc, nullptr);
    const json j = json::parse(text, nullptr, false);
    bson_free(text);
    if (!j.is_object()) continue;
    ArtifactFile f = from_files_doc(j);
    if (unfinished.count(f.file_id)) continue;
    bson_iter_t it;
    const bool dated = bson_iter_init_find(&it, doc, "uploadDate") && BSON_ITER_HOLDS_DATE_TIME(&it);
    found.emplace_back(dated ? bson_iter_date_time(&it) : 0, std::move(f));
  }
  bson_error_t error;
  if (mongoc_cursor_error(cur.get(), &error))
    impl_->fail(error, fmt::format("listing GridFS {}.{} at {} failed", impl_->database, kBucket,
                                   impl_->client.redacted_uri()));
  // A process lost between completing an artifact's new copy and deleting the old one leaves
  // both: the newer copy of each name is the artifact.
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return std::tie(a.second.artifact, a.second.name, b.first, b.second.file_id) <
           std::tie(b.second.artifact, b.second.name, a.first, a.second.file_id);
  });
  std::vector<ArtifactFile> out;
  for (auto& [date, f] : found)
    if (out.empty() || out.back().artifact != f.artifact || out.back().name != f.name) out.push_back(std::move(f));
  return out;
}

void ArtifactStore::download(const std::string& run_id, const std::string& artifact,
                             const std::vector<ArtifactFile>& files, const std::string& dir) {
  check_run_id(run_id, "the run to download from is");
  check_artifact_name(artifact, fmt::format("run {} lists an artifact named", run_id));
  if (files.empty())
    throw Error(fmt::format("run {} has no artifact '{}' in GridFS {}.{} at {}: `lora-runs show {}` lists what it has",
                            run_id, artifact, impl_->database, kBucket, impl_->client.redacted_uri(), run_id));
  for (const ArtifactFile& f : files)
    check_relative_file_name(f.name, fmt::format("run {} lists a file of {} named", run_id, artifact));
  std::error_code ec;
  if (fs::exists(dir) && !(fs::is_directory(dir, ec) && fs::is_empty(dir, ec)))
    throw Error(fmt::format("{} exists and is not empty: download into a new directory, or remove it first", dir));
  const fs::path tmp = fmt::format("{}.part.{}", dir, getpid());
  fs::remove_all(tmp, ec);
  try {
    for (const ArtifactFile& f : files) impl_->fetch_file(run_id, artifact, f, tmp / f.name);
    io::sync_dir(tmp.string());
    fs::rename(tmp, dir);  // (over an empty directory, as rename(2) allows)
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

json ArtifactStore::run_record(const std::string& run_id) {
  check_run_id(run_id, "the run named is");
  const std::vector<json> found = impl_->client.find(impl_->database, "runs", {{"_id", {{"$oid", run_id}}}}, 1);
  if (found.empty())
    throw Error(fmt::format("no run {} in {}.runs at {}: `lora-runs list --db {}` shows the runs there", run_id,
                            impl_->database, impl_->client.redacted_uri(), impl_->database));
  return found.front();
}

int64_t ArtifactStore::remove(const std::string& run_id, const std::string& artifact) {
  const std::vector<ArtifactFile> files = list(run_id, artifact);
  impl_->purge(run_id, files);
  return static_cast<int64_t>(files.size());
}

std::pair<std::string, std::string> split_run_ref(const std::string& ref) {
  const size_t slash = ref.find('/');
  if (slash == std::string::npos) return {ref, ""};
  return {ref.substr(0, slash), ref.substr(slash + 1)};
}

}  // namespace lorarun::track

namespace lorarun::track {

std::vector<std::string> recorded_artifacts(const json& run) {
  const std::string id = run.contains("_id") && run["_id"].is_object() ? run["_id"].value("$oid", "") : "";
  const json list = run.value("artifacts", json::array());
  if (!list.is_array()) throw ConfigError(fmt::format("run {}: its record's artifacts are not a list", printable(id)));
  std::vector<std::string> out;
  for (const json& a : list) {
    const std::string name = a.is_object() && a.contains("artifact") && a["artifact"].is_string()
                                 ? a["artifact"].get<std::string>()
                                 : a.dump();
    check_artifact_name(name, fmt::format("run {} lists an artifact named", printable(id)));
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

std::vector<ArtifactFile> recorded_files(const json& run, const std::string& artifact) {
  const std::string id = run.contains("_id") && run["_id"].is_object() ? run["_id"].value("$oid", "") : "";
  const std::string where = fmt::format("run {}", printable(id));
  std::vector<ArtifactFile> out;
  for (const std::string& name : recorded_artifacts(run)) {
    if (name != artifact) continue;
    for (const json& a : run["artifacts"]) {
      if (a.value("artifact", "") != artifact) continue;
      const json files = a.value("files", json::array());
      if (!files.is_array())
        throw ConfigError(fmt::format("{}: the files of {} in its record are not a list", where, name));
      for (const json& f : files) {
        const auto text = [&](const char* key) {
          return f.is_object() && f.contains(key) && f[key].is_string() ? f[key].get<std::string>() : std::string();
        };
        ArtifactFile file{.artifact = artifact,
                          .name = text("name"),
                          .bytes = -1,
                          .sha256 = text("sha256"),
                          .file_id = text("file_id")};
        if (f.is_object() && f.contains("bytes") && f["bytes"].is_number_integer())
          file.bytes = f["bytes"].get<int64_t>();
        check_relative_file_name(file.name, fmt::format("{} lists a file of {} named", where, name));
        const bool sha_ok = file.sha256.size() == 64 && std::all_of(file.sha256.begin(), file.sha256.end(), [](char c) {
                              return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
                            });
        if (!is_run_id(file.file_id) || !sha_ok || file.bytes < 0)
          throw ConfigError(
              fmt::format("{} lists {} of {} without a valid GridFS id, size and sha256: the record was not "
                          "written by lora-train; refusing it",
                          where, file.name, name));
        out.push_back(std::move(file));
      }
    }
  }
  return out;
}

std::string artifact_named(const json& run, const std::string& named, const std::string& who) {
  if (!named.empty() && !is_adapter_name(named)) return named;  // (checked by the caller)
  const std::string prefix = named.empty() ? "" : named + "/";
  int last = -1;
  std::vector<std::string> adapters;
  for (const std::string& a : recorded_artifacts(run)) {
    if (const size_t slash = a.find('/'); slash != std::string::npos) {
      const std::string adapter = a.substr(0, slash);
      if (std::find(adapters.begin(), adapters.end(), adapter) == adapters.end()) adapters.push_back(adapter);
    }
    if (a.starts_with(prefix + "epoch_") && a.find('/', prefix.size()) == std::string::npos)
      last = std::max(last, std::atoi(a.c_str() + prefix.size() + 6));
  }
  if (last >= 0) return fmt::format("{}epoch_{}", prefix, last);
  if (named.empty() && !adapters.empty())
    throw Error(
        fmt::format("{}: the run is a job of many adapters ({}): name one as …/NAME (its last epoch), "
                    "…/NAME/epoch_N or …/NAME/best",
                    who, fmt::join(adapters, ", ")));
  throw Error(
      fmt::format("{}: the run stored no epoch adapter{} in GridFS (it ran without checkpoint.store: mongodb, "
                  "or kept no epoch): name one (…/best, …/epoch_N)",
                  who, named.empty() ? "" : fmt::format(" of '{}'", named)));
}

}  // namespace lorarun::track
