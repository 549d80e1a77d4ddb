// A MongoDB connection (mongo-c-driver) that reports failures as one redacted line.
#pragma once
#include <chrono>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "util/error.hpp"

struct _mongoc_client_t;

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

// A document with its _id as canonical extended JSON {"_id": …} (doc: relaxed extended JSON,
// discarded when the server's BSON has no JSON form, e.g. invalid UTF-8).
struct Found {
  std::string id;
  nlohmann::json doc;
};

// The _id value of a canonical {"_id": …} as relaxed extended JSON (7, {"$oid": "65f…"}).
std::string relaxed_id(const std::string& canonical_id);

class Client {
 public:
  // Parses `uri` (its password is registered for scrubbing). `timeout` bounds server selection
  // and connecting unless the URI sets serverSelectionTimeoutMS / connectTimeoutMS itself.
  // Throws lorarun::Error for a malformed URI. Does not contact the server yet.
  Client(const std::string& uri, std::chrono::milliseconds timeout);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // hello + buildInfo on the admin database. Throws lorarun::Error when unreachable.
  ServerInfo server_info();

  // Collection names of `db`.
  std::vector<std::string> collections(const std::string& db);

  // The _id of every document matching `filter` (extended JSON), sorted by _id, each as the
  // canonical extended JSON of {"_id": …} so that its BSON type survives the round trip.
  std::vector<std::string> sorted_ids(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                                      std::optional<int64_t> limit = {});

  // The documents with these ids (as sorted_ids gives them), in the same order, as relaxed
  // extended JSON. `fields` (if not empty) limits what the server sends.
  std::vector<nlohmann::json> find_by_ids(const std::string& db, const std::string& coll,
                                          const std::vector<std::string>& ids, const std::vector<std::string>& fields);

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

 private:
  std::string redacted_uri_;
  std::string first_host_;
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

  // The documents matching `filter`, in _id order, as relaxed extended JSON.
  std::vector<nlohmann::json> find(const std::string& db, const std::string& coll, const nlohmann::json& filter,
                                   std::optional<int64_t> limit = {});
};

}  // namespace lorarun::data
