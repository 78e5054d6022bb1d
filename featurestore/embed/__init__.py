"""``featurestore embed``: slide and patient embeddings from a bag split, with lineage
(docs/EXTRACT.md, "Slide and patient embeddings: featurestore embed").

``rows`` (one row per bag or per group), ``pooling`` (mean/max in numpy over reused buffers),
``slide_encoders`` (specs, requirements, torch modules), ``run`` (the resumable, torchrun-aware run).
"""
