"""The tiny BERT configuration the export/import tests build models from (random weights:
what they check is names, shapes and loading, not what the model knows)."""

BERT = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
