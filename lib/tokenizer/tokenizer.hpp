// Tokenizers read from a Hugging Face tokenizer.json (being written).
#pragma once
