"""Train data: the text corpus and its batches, data sets of examples, packing, tokenizing."""
