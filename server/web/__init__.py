"""The store's web page: catalog, precision report and feature pictures (docs/SERVER.md, "Web page").

Server-rendered HTML with inline SVG plots and PNG pictures made with numpy and zlib; no script,
no external request (the stylesheet and icon ship in ``static/``), no torch.

| module | job |
|---|---|
| ``routes`` | the page's routes; ``install(app, state)`` adds them to the app |
| ``catalog`` | one row per split from its metadata document, cached by the document's bytes |
| ``views`` | the pages as functions of what they show (no I/O) |
| ``markup`` | HTML escaped by default (``Html``, ``h``), the page shell |
| ``plots`` | inline SVG: per-channel mean/std, histograms |
| ``pictures`` | principal components of tokens, the PCA picture, the slide map (numpy) |
| ``figures`` | pictures with bounded work per request, and their cache |
| ``png`` | PNG encoding with zlib |
| ``session`` | browser sign-in: ``?token=`` or the form, then an HttpOnly cookie |
| ``security`` | the pages' response headers (CSP and friends) |
| ``blas`` | numpy's BLAS threads of a server process, set once at start-up |
"""
