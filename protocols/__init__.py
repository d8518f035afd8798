"""The seams between the layers: what the training loop (recipes/) asks of a parallelism mode
(recipes' single and fsdp2, the slidedp/ runtime). Below both, so neither imports the other."""
