"""Glue between flashgen and frameworks, one module per framework, each imported only on request.

`import flashgen` imports none of them; `flashgen.integrations.transformers` needs the
`transformers` extra (`pip install flashgen[transformers]`).
"""
