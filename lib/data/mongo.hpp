// A MongoDB connection (mongo-c-driver) that reports failures as one redacted line.
#pragma once
#include <chrono>
#include <memory>
#include <string>

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
