"""fairseq optimizers of the plugin."""
