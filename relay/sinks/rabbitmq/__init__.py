"""The RabbitMQ sink (aio-pika): publisher confirms, mandatory routing."""
