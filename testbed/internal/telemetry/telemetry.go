// Package telemetry sets up the OpenTelemetry SDK for one service process.
//
// Every span carries the resource attributes service.name and service.instance.id. Spans are
// exported over OTLP with the SDK's default BatchSpanProcessor settings (or OTEL_BSP_* from
// the environment, which the SDK reads itself): over gRPC to "host:port" (the Collector's
// 4317), or over HTTP/protobuf when the endpoint is written "http://host:port" (its 4318).
// An empty endpoint exports nothing but still creates spans, so trace context propagates.
package telemetry

import (
	"context"
	"fmt"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Setup installs a global tracer provider and the W3C trace-context propagator. The returned
// function flushes and shuts the provider down.
func Setup(ctx context.Context, service, instance, endpoint string) (func(context.Context) error, error) {
	res := resource.NewSchemaless(
		attribute.String("service.name", service),
		attribute.String("service.instance.id", instance),
		attribute.String("telemetry.sdk.language", "go"),
	)
	opts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	if endpoint != "" {
		exp, err := newExporter(ctx, endpoint)
		if err != nil {
			return nil, err
		}
		opts = append(opts, sdktrace.WithBatcher(exp))
	}
	tp := sdktrace.NewTracerProvider(opts...)
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	return tp.Shutdown, nil
}

func newExporter(ctx context.Context, endpoint string) (sdktrace.SpanExporter, error) {
	var (
		exp sdktrace.SpanExporter
		err error
	)
	if rest, ok := strings.CutPrefix(endpoint, "http://"); ok {
		exp, err = otlptracehttp.New(ctx, otlptracehttp.WithEndpoint(strings.TrimSuffix(rest, "/")),
			otlptracehttp.WithInsecure())
	} else {
		exp, err = otlptracegrpc.New(ctx, otlptracegrpc.WithEndpoint(endpoint), otlptracegrpc.WithInsecure())
	}
	if err != nil {
		return nil, fmt.Errorf("otlp exporter for %q: %w", endpoint, err)
	}
	return exp, nil
}
