"""bmeg: find and fix the microservices that make an application slow, from distributed traces.

Data flows one way: readers (`bmeg.traces`) -> span table -> call graphs (`bmeg.graphs`)
-> models (`bmeg.models`) -> `Diagnosis` -> REST / Kafka / mitigation.
"""

__version__ = "0.1.0"
