// A MongoDB connection (mongo-c-driver) that reports failures as one redacted line.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "data/document.hpp"
#include "util/error.hpp"

struct _mongoc_client_t;
struct _bson_error_t;

namespace lorarun::data {

struct ServerInfo {
  std::string version;           // buildInfo.version (the MongoDB version the server speaks)
  std::string ferretdb_version;  // buildInfo.ferretdbVersion, empty on a real MongoDB
  std::string address;           // first host of the URI
};

// The server could not be reached or dropped the connection: worth retrying later.
struct ConnectionError : Error {
  using Error::Error;
};

// The server answered a request with an error (a filter it rejects, a missing permission, …).
struct ServerError : Error {
  ServerError(const std::string& message, int32_t code, std::string reason)
      : Error(message), code(code), reason(std::move(reason)) {}
  int32_t code;        // the server's error code (2: BadValue, 13: Unauthorized, …; 0: not the server's)
  std::string reason;  // the server's own words, secrets scrubbed
};

// What a failed request means for the caller.
enum class Failure {
  Unreachable,  // no answer: refused, timed out, dropped, shutting down (ConnectionError; retry later)
  Credentials,  // the server refused the user/password, or wants some (retrying cannot help)
  Other,        // the server answered with an error: a bad filter, a missing permission, …
};

// The class of a mongo-c-driver error, from bson_error_t's domain and code (error API 2).
Failure classify(uint32_t domain, uint32_t code);

// A document with its _id as canonical extended JSON {"_id": …} (doc: relaxed extended JSON,
// discarded when the server's BSON has no JSON form). A string or key that is not valid UTF-8
// discards doc and names its field in invalid_utf8 (dotted: "messages.1.content").
struct Found {
  std::string id;
  Document doc;
  std::string invalid_utf8 = {};
  int32_t source = 0;     // data.sources: the index of the source it was read from
  int64_t position = -1;  // its position in its selection, where the reader knows it (stream runs)
};

// A document as the server sends it (`size` bytes of BSON) as a Found, checked for UTF-8 by
// valid_utf8() (the check JSONL lines get), whatever libbson would make of a bad string.
Found decode_document(const uint8_t* bson, size_t size);

// Where a Client's URI and timeout came from, named in its errors' fixes.
struct Origin {
  std::string uri = "the URI (data.uri, --uri or LORARUN_MONGODB_URI)";
  std::string timeout = "";  // the key that set it ("data.timeout_s"), if one did
};

// The _id value of a canonical {"_id": …} as relaxed extended JSON (7, {"$oid": "65f…"}).
std::string relaxed_id(const std::string& canonical_id);

class Client {
 public:
  // Parses `uri` (its password is registered for scrubbing). `timeout` bounds server selection
  // and connecting unless the URI sets serverSelectionTimeoutMS / connectTimeoutMS itself (the
  // URI wins). Throws lorarun::Error for a malformed URI. Does not contact the server yet.
  // Every request that fails throws: ConnectionError ("cannot reach MongoDB at …" when no server
  // answered), Error "MongoDB at … refused the credentials …" for authentication, ServerError
  // otherwise.
  Client(const std::string& uri, std::chrono::milliseconds timeout, Origin origin = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // hello + buildInfo on the admin database. Throws lorarun::Error when unreachable.
  ServerInfo server_info();

  // Collection names of `db`.
  std::vector<std::string> collections(const std::string& db);

  // Calls `each` with the _id of every document matching `filter` (extended JSON), sorted by _id,
  // each as the canonical extended JSON of {"_id": …} so that its BSON type survives the round
  // trip. Nothing is kept here: the caller decides what the listing costs in memory.
  void sorted_ids(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                  std::optional<int64_t> limit, const std::function<void(const std::string&)>& each);

  // The documents with these ids (as sorted_ids gives them), in the same order (doc null where
  // one is gone); an id given twice gets its document twice. `fields` (if not empty) limits what
  // the server sends.
  std::vector<Found> find_by_ids(const std::string& db, const std::string& coll, const std::vector<std::string>& ids,
                                 const std::vector<std::string>& fields);

  // The distinct values of `field` among the documents matching `filter` (the server's distinct
  // command: an array's items count one by one), as relaxed extended JSON; a value with no JSON
  // form (text that is not UTF-8) throws lorarun::Error naming the field.
  std::vector<nlohmann::json> distinct(const std::string& db, const std::string& coll, const std::string& field,
                                       const nlohmann::json& filter);

  // How many documents match `filter` (at most `limit`).
  int64_t count(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                std::optional<int64_t> limit = {});

  // Up to `limit` documents matching `filter` in _id order: those after `after` (an id as
  // sorted_ids gives it), or with `after` empty, from the `skip`-th on. One cursor, one query;
  // repeating a call repeats the same documents. Failures to reach the server: ConnectionError.
  std::vector<Found> find_sorted(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                                 const std::string& after, int64_t skip, int64_t limit,
                                 const std::vector<std::string>& fields);

  // Drops a collection (no error if it does not exist).
  void drop(const std::string& db, const std::string& coll);

  // Inserts documents (extended JSON) in batches; returns how many were inserted.
  int64_t insert_many(const std::string& db, const std::string& coll, const std::vector<nlohmann::json>& docs);

  const std::string& redacted_uri() const { return redacted_uri_; }

  // Throws the error for a failed request (see the constructor); `what` starts the message.
  [[noreturn]] void fail(const _bson_error_t& e, const std::string& what) const;

  // The driver's client, for what this class does not wrap (GridFS in lib/track/artifacts.cpp).
  _mongoc_client_t* native() const { return client_.get(); }

 private:
  // A document whose _id has no JSON form (a string that is not UTF-8) cannot be addressed.
  [[noreturn]] void bad_id(const std::string& db, const std::string& coll) const;

  std::string redacted_uri_;
  std::string first_host_;
  Origin origin_;
  std::string waited_;     // "20 s (data.timeout_s)" or "… (serverSelectionTimeoutMS in the URI)"
  bool has_user_ = false;  // the URI names a user
  struct ClientDeleter {
    void operator()(_mongoc_client_t* c) const;
  };
  std::unique_ptr<_mongoc_client_t, ClientDeleter> client_;

 public:
  // --- Single documents, for run records (lib/track) ---

  // Inserts `doc` (extended JSON), adding an ObjectId _id when it has none; returns that id as
  // 24 hex digits (or the JSON text of a non-ObjectId _id).
  std::string insert_one(const std::string& db, const std::string& coll, nlohmann::json doc);

  // Applies `update` ({"$set": …, "$push": …}) to the first document matching `filter`; returns
  // whether one matched.
  bool update_one(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                  const nlohmann::json& update);

  // Deletes every document matching `filter`; returns how many were deleted.
  int64_t delete_many(const std::string& db, const std::string& coll, const nlohmann::json& filter);

  // The documents matching `filter`, in _id order, as relaxed extended JSON; one with no JSON form
  // (text that is not UTF-8: not lorarun's writing) is left out, with a warning.
  std::vector<nlohmann::json> find(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                                   std::optional<int64_t> limit = {});
};

}  // namespace lorarun::data
