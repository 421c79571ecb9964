package stores

import (
	"context"
	"errors"
	"fmt"

	"github.com/bradfitz/gomemcache/memcache"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// Memcached is a gomemcache client whose calls are client spans ("memcached get_multi") with
// db.system=memcached and peer.service, and whose concurrent calls are bounded by a pool of
// connections (gomemcache itself opens as many as there are concurrent calls).
type Memcached struct {
	client *memcache.Client
	conns  chan struct{}
	attrs  []attribute.KeyValue
	tracer trace.Tracer
}

// NewMemcached returns a client of the memcached at addr with a pool of size connections,
// whose spans name the store peer.
func NewMemcached(addr string, size int, peer string) *Memcached {
	c := memcache.New(addr)
	c.MaxIdleConns = size
	return &Memcached{
		client: c,
		conns:  make(chan struct{}, size),
		attrs: []attribute.KeyValue{
			attribute.String("db.system", "memcached"),
			attribute.String("peer.service", peer),
			attribute.String("server.address", addr),
		},
		tracer: otel.Tracer("bmeg.dev/testbed/stores/memcached"),
	}
}

func (m *Memcached) start(ctx context.Context, op string, keys int) (trace.Span, error) {
	_, span := m.tracer.Start(ctx, "memcached "+op, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(m.attrs...),
		trace.WithAttributes(attribute.String("db.operation.name", op), attribute.Int("db.memcached.keys", keys)))
	select { // the wait for a pooled connection is part of the call, as with pgx and go-redis
	case m.conns <- struct{}{}:
		return span, nil
	case <-ctx.Done():
		end(span, ctx.Err())
		return nil, ctx.Err()
	}
}

func (m *Memcached) done(span trace.Span, err error) {
	<-m.conns
	end(span, err)
}

func end(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// GetMulti returns the values of the keys that are present.
func (m *Memcached) GetMulti(ctx context.Context, keys []string) (map[string][]byte, error) {
	span, err := m.start(ctx, "get_multi", len(keys))
	if err != nil {
		return nil, err
	}
	items, err := m.client.GetMulti(keys)
	span.SetAttributes(attribute.Int("db.memcached.hits", len(items)))
	m.done(span, err)
	if err != nil {
		return nil, fmt.Errorf("memcached get_multi: %w", err)
	}
	out := make(map[string][]byte, len(items))
	for k, it := range items {
		out[k] = it.Value
	}
	return out, nil
}

// Get returns the value of key, or ok=false when it is absent.
func (m *Memcached) Get(ctx context.Context, key string) (value []byte, ok bool, err error) {
	span, err := m.start(ctx, "get", 1)
	if err != nil {
		return nil, false, err
	}
	it, err := m.client.Get(key)
	if errors.Is(err, memcache.ErrCacheMiss) {
		span.SetAttributes(attribute.Int("db.memcached.hits", 0))
		m.done(span, nil)
		return nil, false, nil
	}
	m.done(span, err)
	if err != nil {
		return nil, false, fmt.Errorf("memcached get: %w", err)
	}
	return it.Value, true, nil
}

// Set stores value under key.
func (m *Memcached) Set(ctx context.Context, key string, value []byte) error {
	span, err := m.start(ctx, "set", 1)
	if err != nil {
		return err
	}
	err = m.client.Set(&memcache.Item{Key: key, Value: value})
	m.done(span, err)
	if err != nil {
		return fmt.Errorf("memcached set: %w", err)
	}
	return nil
}

// Ping checks that the server answers (untraced: health checks are not requests).
func (m *Memcached) Ping() error { return m.client.Ping() }

// Close closes the idle connections.
func (m *Memcached) Close() error { return m.client.Close() }
