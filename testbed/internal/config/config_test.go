package config

import (
	"strings"
	"testing"
)

func TestParseDefaults(t *testing.T) {
	c, err := Parse([]byte(`{"service": "text-service", "listen": "127.0.0.1:7102",
		"peers": {"url-shorten-service": "http://127.0.0.1:7103"}}`), "test")
	if err != nil {
		t.Fatal(err)
	}
	if c.Workers != DefaultWorkers || c.DBPool != DefaultDBPool || c.CacheItems != DefaultCacheItems ||
		c.QueueLimit != DefaultQueueLimit || c.Instance != "text-service@127.0.0.1:7102" {
		t.Fatalf("defaults not applied: %+v", c)
	}
}

func TestParseRejects(t *testing.T) {
	for doc, want := range map[string]string{
		`{"service": "a", "listen": "127.0.0.1:1", "wrokers": 3}`:                  "wrokers",
		`{"listen": "127.0.0.1:1"}`:                                                `"service"`,
		`{"service": "a", "listen": "nowhere"}`:                                    `"listen"`,
		`{"service": "a", "listen": "127.0.0.1:1", "workers": -1}`:                 `"workers"`,
		`{"service": "a", "listen": "127.0.0.1:1", "redis_db": 16}`:                `"redis_db"`,
		`{"service": "a", "listen": "127.0.0.1:1", "peers": {"b": "127.0.0.1:2"}}`: "http://",
		`[1, 2]`: "cannot unmarshal",
	} {
		_, err := Parse([]byte(doc), "test")
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("%s: error %v, want one naming %s", doc, err, want)
		}
	}
}
