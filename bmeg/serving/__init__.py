"""Serving diagnoses: the REST API with its web page, and the Kafka streaming consumer.

`bmeg.serving.app.create_app` builds the FastAPI app (`bmeg serve`); `bmeg.serving.consumer`
holds the Kafka loop (`bmeg consume`), built on the Kafka-free `assembler` and `offsets`.
"""
