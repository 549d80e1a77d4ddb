// A MongoDB connection (mongo-c-driver) that reports failures as one redacted line.
#pragma once
#include <chrono>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

struct _mongoc_client_t;

namespace lorarun::data {

struct ServerInfo {
  std::string version;           // buildInfo.version (the MongoDB version the server speaks)
  std::string ferretdb_version;  // buildInfo.ferretdbVersion, empty on a real MongoDB
  std::string address;           // first host of the URI
};

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
};

}  // namespace lorarun::data
