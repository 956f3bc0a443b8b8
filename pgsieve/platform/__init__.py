"""What every part stands on: one settings object, the metadata store (engine,
sessions, typed models, migrations), credentials and the secret box, stable error codes,
Prometheus metrics, fault points, the connection policy every source and target connection
goes through, and PostgreSQL server helpers. Imports nothing else of pgsieve.
"""
