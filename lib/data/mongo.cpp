#include "data/mongo.hpp"

#include <fmt/format.h>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "data/example.hpp"
#include "data/mongo_handles.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/secrets.hpp"

namespace lorarun::data {
namespace {

// What the driver logs while a URI is parsed is the precise reason ("Port could not be
// parsed"): it is collected into the error message instead of printed on its own line.
thread_local std::string* driver_notes = nullptr;

// The driver may log URIs or hosts: everything it says goes through scrub(). Warnings are
// printed only with LORARUN_DEBUG set; errors always.
void log_handler(mongoc_log_level_t level, const char* domain, const char* message, void*) {
  if (driver_notes && level <= MONGOC_LOG_LEVEL_WARNING) {
    *driver_notes += fmt::format("{}{}", driver_notes->empty() ? "" : "; ", message);
    return;
  }
  static const bool debug = std::getenv("LORARUN_DEBUG") != nullptr;
  if (level > (debug ? MONGOC_LOG_LEVEL_WARNING : MONGOC_LOG_LEVEL_ERROR)) return;
  std::fputs(scrub(fmt::format("mongoc: {}: {}\n", domain, message)).c_str(), stderr);
}

void init_driver() {
  static const bool done = [] {
    // The driver's shared-memory counters (for mongoc-stat only) fail when a killed process of the
    // same pid left its /dev/shm/mongoc-<pid> behind, and it then warns before any handler: off.
    // (A driver built to initialise itself when the library loads has read the environment
    // already; lorarun sets MONGOC_DISABLE_SHM for its ranks, and scripts/test for the tests.)
    setenv("MONGOC_DISABLE_SHM", "1", 0);
    mongoc_log_set_handler(log_handler, nullptr);
    mongoc_init();
    return true;
  }();
  (void)done;
}

struct UriDeleter {
  void operator()(mongoc_uri_t* u) const { mongoc_uri_destroy(u); }
};

// A bson_t on the stack that is always destroyed.
struct Bson {
  bson_t b = BSON_INITIALIZER;
  ~Bson() { bson_destroy(&b); }
};

std::string string_field(const bson_t* doc, const char* key) {
  bson_iter_t it;
  if (bson_iter_init_find(&it, doc, key) && BSON_ITER_HOLDS_UTF8(&it)) return bson_iter_utf8(&it, nullptr);
  return {};
}

}  // namespace

void Client::ClientDeleter::operator()(_mongoc_client_t* c) const { mongoc_client_destroy(c); }

Client::Client(const std::string& uri_text, std::chrono::milliseconds timeout, Origin origin)
    : origin_(std::move(origin)) {
  init_driver();
  register_uri_secret(uri_text);
  redacted_uri_ = redact_uri(uri_text);
  bson_error_t error;
  std::string notes;
  driver_notes = &notes;
  std::unique_ptr<mongoc_uri_t, UriDeleter> uri(mongoc_uri_new_with_error(uri_text.c_str(), &error));
  driver_notes = nullptr;
  if (!uri)
    throw Error(
        fmt::format("invalid MongoDB URI '{}': {}{}; expected "
                    "mongodb://[user:password@]host[:port]/[database][?options], with '@', '/' and ':' in "
                    "the user name or password percent-encoded (%40, %2F, %3A)",
                    redacted_uri_, scrub(error.message), notes.empty() ? "" : " (" + scrub(notes) + ")"));
  // The driver ends the password at the first '@'; a password with an unescaped '@' would be cut
  // there and its tail taken for a host name (and shown in the driver's messages).
  if (const char* parsed = mongoc_uri_get_password(uri.get())) {
    register_secret(parsed);
    if (parsed != percent_decode(uri_password(uri_text)))
      throw Error(fmt::format("the password in MongoDB URI '{}' holds an unescaped '@': percent-encode it as %40",
                              redacted_uri_));
  }
  // The recipe's timeout unless the URI says otherwise (the URI wins, key by key).
  const auto ms = static_cast<int32_t>(timeout.count());
  const bool uri_sets = mongoc_uri_has_option(uri.get(), MONGOC_URI_SERVERSELECTIONTIMEOUTMS);
  for (const char* key : {MONGOC_URI_SERVERSELECTIONTIMEOUTMS, MONGOC_URI_CONNECTTIMEOUTMS})
    if (!mongoc_uri_has_option(uri.get(), key)) mongoc_uri_set_option_as_int32(uri.get(), key, ms);
  const int32_t selection = mongoc_uri_get_option_as_int32(uri.get(), MONGOC_URI_SERVERSELECTIONTIMEOUTMS, ms);
  waited_ = uri_sets
                ? fmt::format("{:g} s (serverSelectionTimeoutMS in the URI)", selection / 1000.0)
                : fmt::format("{:g} s{}", ms / 1000.0, origin_.timeout.empty() ? "" : " (" + origin_.timeout + ")");
  has_user_ = mongoc_uri_get_username(uri.get()) != nullptr;
  if (const mongoc_host_list_t* hosts = mongoc_uri_get_hosts(uri.get())) first_host_ = hosts->host_and_port;
  client_.reset(mongoc_client_new_from_uri_with_error(uri.get(), &error));
  if (!client_) throw Error(fmt::format("cannot use MongoDB URI '{}': {}", redacted_uri_, scrub(error.message)));
  mongoc_client_set_error_api(client_.get(), MONGOC_ERROR_API_VERSION_2);
  mongoc_client_set_appname(client_.get(), "lorarun");
}

Client::~Client() = default;

Failure classify(uint32_t domain, uint32_t code) {
  if (domain == MONGOC_ERROR_CLIENT && code == MONGOC_ERROR_CLIENT_AUTHENTICATE) return Failure::Credentials;
  if (domain == MONGOC_ERROR_STREAM || domain == MONGOC_ERROR_SERVER_SELECTION) return Failure::Unreachable;
  if (domain == MONGOC_ERROR_SERVER) {
    // Unauthorized, AuthenticationFailed; then shutting down / stepping down / not primary.
    if (code == 13 || code == 18) return Failure::Credentials;
    if (code == 91 || code == 11600 || code == 11602 || code == 189 || code == 6) return Failure::Unreachable;
  }
  return Failure::Other;
}

void Client::fail(const bson_error_t& e, const std::string& what) const {
  const std::string msg = scrub(e.message);
  switch (classify(e.domain, e.code)) {
    case Failure::Credentials:
      if (!has_user_)
        throw Error(
            fmt::format("MongoDB at {} requires authentication: put the user, password and authSource in {} "
                        "(server: {})",
                        redacted_uri_, origin_.uri, msg));
      if (e.domain == MONGOC_ERROR_SERVER && e.code == 13) break;  // logged in, lacks a role: the server says which
      throw Error(
          fmt::format("MongoDB at {} refused the credentials: check the user, password and authSource in {} "
                      "(server: {})",
                      redacted_uri_, origin_.uri, msg));
    case Failure::Unreachable:
      if (e.domain == MONGOC_ERROR_SERVER_SELECTION)
        throw ConnectionError(fmt::format("cannot reach MongoDB at {} within {}: {}: start the server or fix {}",
                                          redacted_uri_, waited_, msg, origin_.uri));
      throw ConnectionError(fmt::format("{}: {}", what, msg));
    case Failure::Other:
      break;
  }
  throw ServerError(fmt::format("{}: {}", what, msg),
                    e.domain == MONGOC_ERROR_SERVER ? static_cast<int32_t>(e.code) : 0, msg);
}

void Client::bad_id(const std::string& db, const std::string& coll) const {
  throw Error(
      fmt::format("a document of {}.{} at {} has an _id that is not valid UTF-8: fix or delete it, or leave it "
                  "out with data.filter",
                  db, coll, redacted_uri_));
}

ServerInfo Client::server_info() {
  ServerInfo info;
  info.address = first_host_;
  for (const char* command : {"hello", "buildInfo"}) {
    Bson cmd, reply;
    BSON_APPEND_INT32(&cmd.b, command, 1);
    bson_error_t error;
    if (!mongoc_client_command_simple(client_.get(), "admin", &cmd.b, nullptr, &reply.b, &error))
      fail(error, fmt::format("cannot reach MongoDB at {}", redacted_uri_));
    if (std::string_view(command) == "buildInfo") {
      info.version = string_field(&reply.b, "version");
      info.ferretdb_version = string_field(&reply.b, "ferretdbVersion");
    }
  }
  return info;
}

BsonPtr to_bson(const nlohmann::json& j, const char* what) {
  bson_error_t error;
  const std::string text = j.dump();
  BsonPtr b(
      bson_new_from_json(reinterpret_cast<const uint8_t*>(text.data()), static_cast<ssize_t>(text.size()), &error));
  if (!b) throw Error(fmt::format("{} is not valid (extended) JSON for MongoDB: {}", what, error.message));
  return b;
}

namespace {

std::string to_json_text(const bson_t* b, bool canonical) {
  size_t n = 0;
  char* s = canonical ? bson_as_canonical_extended_json(b, &n) : bson_as_relaxed_extended_json(b, &n);
  if (!s) return {};  // no JSON form (invalid UTF-8): the caller sees a discarded document
  std::string out(s, n);
  bson_free(s);
  return out;
}

// Shows a key with its bytes that are not UTF-8 as \\xNN (an error message stays valid UTF-8).
std::string shown_key(std::string_view key) {
  if (valid_utf8(key)) return std::string(key);
  std::string out;
  for (const char c : key)
    out += static_cast<unsigned char>(c) < 0x80 ? std::string(1, c)
                                                : fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
  return out;
}

// The dotted path of the first key or string under `it` that is not valid UTF-8 ("" if none).
std::string first_invalid_utf8(bson_iter_t* it, const std::string& prefix) {
  while (bson_iter_next(it)) {
    const std::string_view key = bson_iter_key(it);
    const std::string path = prefix + shown_key(key);
    if (!valid_utf8(key)) return path;
    if (BSON_ITER_HOLDS_UTF8(it)) {
      uint32_t n = 0;
      const char* s = bson_iter_utf8(it, &n);
      if (!valid_utf8(std::string_view(s, n))) return path;
    } else if (BSON_ITER_HOLDS_DOCUMENT(it) || BSON_ITER_HOLDS_ARRAY(it)) {
      bson_iter_t child;
      if (bson_iter_recurse(it, &child))
        if (std::string p = first_invalid_utf8(&child, path + "."); !p.empty()) return p;
    }
  }
  return {};
}

// The canonical {"_id": …} of a document ("" when it has none or it has no JSON form).
std::string canonical_id(const bson_t* doc) {
  bson_iter_t it;
  if (!bson_iter_init_find(&it, doc, "_id")) return {};
  Bson key;
  bson_append_iter(&key.b, "_id", -1, &it);
  return to_json_text(&key.b, true);
}

Found decode(const bson_t* doc) {
  Found f;
  f.id = canonical_id(doc);
  f.doc = Document(Document::value_t::discarded);
  bson_iter_t it;
  if (bson_iter_init(&it, doc)) f.invalid_utf8 = first_invalid_utf8(&it, "");
  if (f.invalid_utf8.empty()) f.doc = Document::parse(to_json_text(doc, false), nullptr, false);
  return f;
}

}  // namespace

Found decode_document(const uint8_t* bson, size_t size) {
  bson_t doc;
  if (!bson_init_static(&doc, bson, size)) return {};
  return decode(&doc);
}

std::string relaxed_id(const std::string& canonical_id) {
  const BsonPtr b = to_bson(nlohmann::json::parse(canonical_id), "an _id");
  const auto j = nlohmann::json::parse(to_json_text(b.get(), false), nullptr, false);
  return j.is_object() && j.contains("_id") ? j["_id"].dump() : canonical_id;
}

std::vector<std::string> Client::collections(const std::string& db) {
  mongoc_database_t* d = mongoc_client_get_database(client_.get(), db.c_str());
  bson_error_t error;
  char** names = mongoc_database_get_collection_names_with_opts(d, nullptr, &error);
  mongoc_database_destroy(d);
  if (!names) fail(error, fmt::format("listing collections of '{}' at {} failed", db, redacted_uri_));
  std::vector<std::string> out;
  for (char** n = names; *n; ++n) out.emplace_back(*n);
  bson_strfreev(names);
  return out;
}

void Client::sorted_ids(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                        std::optional<int64_t> limit, const std::function<void(const std::string&)>& each) {
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> c(
      mongoc_client_get_collection(client_.get(), db.c_str(), coll.c_str()));
  const BsonPtr query = to_bson(filter, "data.filter");
  nlohmann::json opts = {{"projection", {{"_id", 1}}}, {"sort", {{"_id", 1}}}};
  if (limit) opts["limit"] = *limit;
  const BsonPtr bopts = to_bson(opts, "query options");
  std::unique_ptr<mongoc_cursor_t, CursorDeleter> cur(
      mongoc_collection_find_with_opts(c.get(), query.get(), bopts.get(), nullptr));
  const bson_t* doc = nullptr;
  while (mongoc_cursor_next(cur.get(), &doc)) {
    const std::string id = to_json_text(doc, true);
    if (id.empty()) bad_id(db, coll);
    each(id);
  }
  bson_error_t error;
  if (mongoc_cursor_error(cur.get(), &error))
    fail(error, fmt::format("querying {}.{} at {} failed", db, coll, redacted_uri_));
}

std::vector<Found> Client::find_by_ids(const std::string& db, const std::string& coll,
                                       const std::vector<std::string>& ids, const std::vector<std::string>& fields) {
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> c(
      mongoc_client_get_collection(client_.get(), db.c_str(), coll.c_str()));
  // An id may come more than once (a mixture repeats an upsampled source's documents): asked for
  // once, its document fills every position that named it.
  nlohmann::json in = nlohmann::json::array();
  std::map<std::string, std::vector<size_t>> where;
  for (size_t i = 0; i < ids.size(); ++i) {
    std::vector<size_t>& at = where[ids[i]];
    if (at.empty()) in.push_back(nlohmann::json::parse(ids[i])["_id"]);
    at.push_back(i);
  }
  const BsonPtr query = to_bson({{"_id", {{"$in", in}}}}, "id query");
  nlohmann::json opts = nlohmann::json::object();
  if (!fields.empty()) {
    for (const std::string& f : fields) opts["projection"][f] = 1;
  }
  const BsonPtr bopts = to_bson(opts, "query options");
  std::unique_ptr<mongoc_cursor_t, CursorDeleter> cur(
      mongoc_collection_find_with_opts(c.get(), query.get(), bopts.get(), nullptr));
  std::vector<Found> out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) out[i].id = ids[i];
  const bson_t* doc = nullptr;
  while (mongoc_cursor_next(cur.get(), &doc)) {
    Found f = decode(doc);
    const auto w = where.find(f.id);
    if (w == where.end()) continue;
    for (size_t k = 1; k < w->second.size(); ++k) out[w->second[k]] = f;
    out[w->second.front()] = std::move(f);
  }
  bson_error_t error;
  if (mongoc_cursor_error(cur.get(), &error))
    fail(error, fmt::format("reading {}.{} at {} failed", db, coll, redacted_uri_));
  return out;  // a document deleted since listing stays null; the caller treats it as bad
}

int64_t Client::count(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                      std::optional<int64_t> limit) {
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> c(
      mongoc_client_get_collection(client_.get(), db.c_str(), coll.c_str()));
  const BsonPtr query = to_bson(filter, "data.filter");
  const BsonPtr opts = to_bson(limit ? nlohmann::json{{"limit", *limit}} : nlohmann::json::object(), "count options");
  bson_error_t error;
  const int64_t n = mongoc_collection_count_documents(c.get(), query.get(), opts.get(), nullptr, nullptr, &error);
  if (n < 0) fail(error, fmt::format("counting {}.{} at {} failed", db, coll, redacted_uri_));
  return n;
}

std::vector<nlohmann::json> Client::distinct(const std::string& db, const std::string& coll, const std::string& field,
                                             const nlohmann::json& filter) {
  const BsonPtr command = to_bson({{"distinct", coll}, {"key", field}, {"query", filter}}, "data.filter");
  std::unique_ptr<mongoc_database_t, DatabaseDeleter> d(mongoc_client_get_database(client_.get(), db.c_str()));
  Bson reply;
  bson_error_t error;
  if (!mongoc_database_read_command_with_opts(d.get(), command.get(), nullptr, nullptr, &reply.b, &error))
    fail(error, fmt::format("listing the values of {} in {}.{} at {} failed", field, db, coll, redacted_uri_));
  const nlohmann::json j = nlohmann::json::parse(to_json_text(&reply.b, false), nullptr, false);
  if (j.is_discarded() || !j.contains("values") || !j["values"].is_array())
    throw Error(fmt::format("the values of {} in {}.{} at {} are not text MongoDB can show as JSON (UTF-8)", field, db,
                            coll, redacted_uri_));
  return j["values"].get<std::vector<nlohmann::json>>();
}

std::vector<Found> Client::find_sorted(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                                       const std::string& after, int64_t skip, int64_t limit,
                                       const std::vector<std::string>& fields) {
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> c(
      mongoc_client_get_collection(client_.get(), db.c_str(), coll.c_str()));
  nlohmann::json q = filter;
  if (!after.empty()) {
    const nlohmann::json past = {{"_id", {{"$gt", nlohmann::json::parse(after)["_id"]}}}};
    q = filter.empty() ? past : nlohmann::json{{"$and", {filter, past}}};
  }
  const BsonPtr query = to_bson(q, "data.filter");
  nlohmann::json opts = {{"sort", {{"_id", 1}}}, {"limit", limit}};
  if (after.empty() && skip > 0) opts["skip"] = skip;
  for (const std::string& f : fields) opts["projection"][f] = 1;
  const BsonPtr bopts = to_bson(opts, "query options");
  std::unique_ptr<mongoc_cursor_t, CursorDeleter> cur(
      mongoc_collection_find_with_opts(c.get(), query.get(), bopts.get(), nullptr));
  std::vector<Found> out;
  const bson_t* doc = nullptr;
  while (mongoc_cursor_next(cur.get(), &doc)) {
    bson_iter_t it;
    if (!bson_iter_init_find(&it, doc, "_id")) continue;
    out.push_back(decode(doc));
    if (out.back().id.empty()) bad_id(db, coll);
  }
  bson_error_t error;
  if (mongoc_cursor_error(cur.get(), &error))
    fail(error, fmt::format("reading {}.{} at {} failed", db, coll, redacted_uri_));
  return out;
}

void Client::drop(const std::string& db, const std::string& coll) {
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> c(
      mongoc_client_get_collection(client_.get(), db.c_str(), coll.c_str()));
  bson_error_t error;
  if (!mongoc_collection_drop(c.get(), &error) && error.code != 26 /* NamespaceNotFound */ &&
      std::string_view(error.message).find("ns not found") == std::string_view::npos)
    fail(error, fmt::format("dropping {}.{} at {} failed", db, coll, redacted_uri_));
}

int64_t Client::insert_many(const std::string& db, const std::string& coll, const std::vector<nlohmann::json>& docs) {
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> c(
      mongoc_client_get_collection(client_.get(), db.c_str(), coll.c_str()));
  constexpr size_t kBatch = 1000;
  int64_t inserted = 0;
  for (size_t start = 0; start < docs.size(); start += kBatch) {
    std::vector<BsonPtr> owned;
    std::vector<const void*> batch;  // const bson_t* (as a template argument bson_t loses its alignment attribute)
    for (size_t i = start; i < std::min(docs.size(), start + kBatch); ++i) {
      owned.push_back(to_bson(docs[i], "a document"));
      batch.push_back(owned.back().get());
    }
    bson_error_t error;
    if (!mongoc_collection_insert_many(c.get(), reinterpret_cast<const bson_t**>(batch.data()), batch.size(), nullptr,
                                       nullptr, &error))
      fail(error, fmt::format("inserting into {}.{} at {} failed", db, coll, redacted_uri_));
    inserted += static_cast<int64_t>(batch.size());
  }
  return inserted;
}

}  // namespace lorarun::data

// --- Single documents, for run records (lib/track) ---
namespace lorarun::data {

std::string Client::insert_one(const std::string& db, const std::string& coll, nlohmann::json doc) {
  std::string id;
  if (!doc.contains("_id")) {
    bson_oid_t oid;
    bson_oid_init(&oid, nullptr);
    char hex[25];
    bson_oid_to_string(&oid, hex);
    id = hex;
    doc["_id"] = {{"$oid", id}};
  } else {
    id = doc["_id"].contains("$oid") ? doc["_id"]["$oid"].get<std::string>() : doc["_id"].dump();
  }
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> c(
      mongoc_client_get_collection(client_.get(), db.c_str(), coll.c_str()));
  const BsonPtr b = to_bson(doc, "a document");
  bson_error_t error;
  if (!mongoc_collection_insert_one(c.get(), b.get(), nullptr, nullptr, &error))
    fail(error, fmt::format("inserting into {}.{} at {} failed", db, coll, redacted_uri_));
  return id;
}

bool Client::update_one(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                        const nlohmann::json& update) {
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> c(
      mongoc_client_get_collection(client_.get(), db.c_str(), coll.c_str()));
  const BsonPtr query = to_bson(filter, "update filter");
  const BsonPtr change = to_bson(update, "update");
  Bson reply;
  bson_error_t error;
  const bool ok = mongoc_collection_update_one(c.get(), query.get(), change.get(), nullptr, &reply.b, &error);
  if (!ok) fail(error, fmt::format("updating {}.{} at {} failed", db, coll, redacted_uri_));
  bson_iter_t it;
  return bson_iter_init_find(&it, &reply.b, "matchedCount") && bson_iter_as_int64(&it) > 0;
}

int64_t Client::delete_many(const std::string& db, const std::string& coll, const nlohmann::json& filter) {
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> c(
      mongoc_client_get_collection(client_.get(), db.c_str(), coll.c_str()));
  const BsonPtr query = to_bson(filter, "delete filter");
  Bson reply;
  bson_error_t error;
  if (!mongoc_collection_delete_many(c.get(), query.get(), nullptr, &reply.b, &error))
    fail(error, fmt::format("deleting from {}.{} at {} failed", db, coll, redacted_uri_));
  bson_iter_t it;
  return bson_iter_init_find(&it, &reply.b, "deletedCount") ? bson_iter_as_int64(&it) : 0;
}

std::vector<nlohmann::json> Client::find(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                                         std::optional<int64_t> limit) {
  std::unique_ptr<mongoc_collection_t, CollectionDeleter> c(
      mongoc_client_get_collection(client_.get(), db.c_str(), coll.c_str()));
  const BsonPtr query = to_bson(filter, "query filter");
  nlohmann::json opts = {{"sort", {{"_id", 1}}}};
  if (limit) opts["limit"] = *limit;
  const BsonPtr bopts = to_bson(opts, "query options");
  std::unique_ptr<mongoc_cursor_t, CursorDeleter> cur(
      mongoc_collection_find_with_opts(c.get(), query.get(), bopts.get(), nullptr));
  std::vector<nlohmann::json> out;
  const bson_t* doc = nullptr;
  int64_t unreadable = 0;  // documents with no JSON form (text that is not UTF-8): not lorarun's writing
  while (mongoc_cursor_next(cur.get(), &doc)) {
    const nlohmann::json j = nlohmann::json::parse(to_json_text(doc, false), nullptr, false);
    if (j.is_object())
      out.push_back(j);
    else
      ++unreadable;
  }
  bson_error_t error;
  if (mongoc_cursor_error(cur.get(), &error))
    fail(error, fmt::format("querying {}.{} at {} failed", db, coll, redacted_uri_));
  if (unreadable > 0)
    warn(fmt::format("{} document(s) of {}.{} at {} hold text that is not UTF-8 (not written by lorarun): left out",
                     unreadable, db, coll, redacted_uri_));
  return out;
}

}  // namespace lorarun::data
