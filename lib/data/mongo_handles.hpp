// RAII for mongo-c-driver handles, and JSON to BSON, for the code that talks to the driver
// directly (lib/data/mongo.cpp, lib/track/artifacts.cpp). Includes the driver's header: keep it
// out of public headers.
#pragma once
#include <mongoc/mongoc.h>
#include <memory>
#include <nlohmann/json.hpp>
#include <utility>

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

// An owned bson_t. (Not a unique_ptr: bson_t's alignment attribute is dropped, with a warning,
// wherever the type is a template argument.)
class BsonPtr {
 public:
  explicit BsonPtr(bson_t* b = nullptr) : b_(b) {}
  ~BsonPtr() {
    if (b_) bson_destroy(b_);
  }
  BsonPtr(BsonPtr&& o) noexcept : b_(o.b_) { o.b_ = nullptr; }
  BsonPtr& operator=(BsonPtr&& o) noexcept {
    std::swap(b_, o.b_);
    return *this;
  }
  BsonPtr(const BsonPtr&) = delete;
  BsonPtr& operator=(const BsonPtr&) = delete;
  bson_t* get() const { return b_; }
  explicit operator bool() const { return b_ != nullptr; }

 private:
  bson_t* b_;
};

// `j` as BSON; throws lorarun::Error "<what> is not valid (extended) JSON for MongoDB: …".
BsonPtr to_bson(const nlohmann::json& j, const char* what);

}  // namespace lorarun::data
