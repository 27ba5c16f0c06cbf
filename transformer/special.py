"""The special token ids every SentencePiece model of this package reserves (tokenizer.py trains them in).

A leaf module: the model, search and batching need these four numbers, not the tokenizer or the corpus
readers behind it.
"""

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
