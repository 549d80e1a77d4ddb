// RAII for mongo-c-driver handles, and JSON to BSON, for the code that talks to the driver
// directly (lib/data/mongo.cpp, lib/track/artifacts.cpp). Includes the driver's header: keep it
// out of public headers.
#pragma once
#include <mongoc/mongoc.h>
#include <memory>
#include <nlohmann/json.hpp>

namespace lorarun::data {

// Calls the driver's destroy function for T.
template <class T, void (*Destroy)(T*)>
struct Destroyer {
  void operator()(T* p) const { Destroy(p); }
};
using CollectionDeleter = Destroyer<mongoc_collection_t, mongoc_collection_destroy>;
using CursorDeleter = Destroyer<mongoc_cursor_t, mongoc_cursor_destroy>;
using DatabaseDeleter = Destroyer<mongoc_database_t, mongoc_database_destroy>;
using BucketDeleter = Destroyer<mongoc_gridfs_bucket_t, mongoc_gridfs_bucket_destroy>;
using BsonPtr = std::unique_ptr<bson_t, Destroyer<bson_t, bson_destroy>>;

// `j` as BSON; throws lorarun::Error "<what> is not valid (extended) JSON for MongoDB: …".
BsonPtr to_bson(const nlohmann::json& j, const char* what);

}  // namespace lorarun::data
