"""Models: the runtime target (`target`, `cache`, `gdn`, `rope`, `loading`), transformers
wrappers for training (`hf`) and the DFlash drafter (`drafter`)."""
