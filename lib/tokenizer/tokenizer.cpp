#include "tokenizer/tokenizer.hpp"
