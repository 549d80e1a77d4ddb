#include "data/mongo.hpp"

#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>
#include <mongoc/mongoc.h>

#include "util/error.hpp"
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
    mongoc_init();
    mongoc_log_set_handler(log_handler, nullptr);
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
  if (bson_iter_init_find(&it, doc, key) && BSON_ITER_HOLDS_UTF8(&it))
    return bson_iter_utf8(&it, nullptr);
  return {};
}

}  // namespace

void Client::ClientDeleter::operator()(_mongoc_client_t* c) const { mongoc_client_destroy(c); }

Client::Client(const std::string& uri_text, std::chrono::milliseconds timeout) {
  init_driver();
  register_uri_secret(uri_text);
  redacted_uri_ = redact_uri(uri_text);
  bson_error_t error;
  std::string notes;
  driver_notes = &notes;
  std::unique_ptr<mongoc_uri_t, UriDeleter> uri(mongoc_uri_new_with_error(uri_text.c_str(), &error));
  driver_notes = nullptr;
  if (!uri)
    throw Error(fmt::format("invalid MongoDB URI '{}': {}{}; expected "
                            "mongodb://[user:password@]host[:port]/[database][?options]",
                            redacted_uri_, scrub(error.message),
                            notes.empty() ? "" : " (" + scrub(notes) + ")"));
  const auto ms = static_cast<int32_t>(timeout.count());
  for (const char* key : {MONGOC_URI_SERVERSELECTIONTIMEOUTMS, MONGOC_URI_CONNECTTIMEOUTMS})
    if (!mongoc_uri_has_option(uri.get(), key)) mongoc_uri_set_option_as_int32(uri.get(), key, ms);
  if (const mongoc_host_list_t* hosts = mongoc_uri_get_hosts(uri.get())) first_host_ = hosts->host_and_port;
  client_.reset(mongoc_client_new_from_uri_with_error(uri.get(), &error));
  if (!client_)
    throw Error(fmt::format("cannot use MongoDB URI '{}': {}", redacted_uri_, scrub(error.message)));
  mongoc_client_set_error_api(client_.get(), MONGOC_ERROR_API_VERSION_2);
  mongoc_client_set_appname(client_.get(), "lorarun");
}

Client::~Client() = default;

ServerInfo Client::server_info() {
  ServerInfo info;
  info.address = first_host_;
  for (const char* command : {"hello", "buildInfo"}) {
    Bson cmd, reply;
    BSON_APPEND_INT32(&cmd.b, command, 1);
    bson_error_t error;
    if (!mongoc_client_command_simple(client_.get(), "admin", &cmd.b, nullptr, &reply.b, &error))
      throw Error(fmt::format("cannot reach MongoDB at {}: {}: start the server or fix the URI "
                              "(--uri, data.uri or LORARUN_MONGODB_URI)",
                              redacted_uri_, scrub(error.message)));
    if (std::string_view(command) == "buildInfo") {
      info.version = string_field(&reply.b, "version");
      info.ferretdb_version = string_field(&reply.b, "ferretdbVersion");
    }
  }
  return info;
}

}  // namespace lorarun::data
